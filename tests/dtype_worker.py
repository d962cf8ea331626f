"""The hand-written parallel modules of one chapter, in float64 and in float32, against one process.

    torchrun --standalone --nproc_per_node=2 tests/dtype_worker.py ch8 OUT.json

The worker of tests/ch3, ch4 and ch8's test_device_dtype.py (launched with gloo on the CPU). For
each dtype every rank builds the same model from one seed, casts it to the dtype, and runs the
parallel version next to the one-process reference (every rank computes it, on the whole batch).
Rank 0 writes, for every module and dtype, the relative L2 gaps to the reference (outputs,
gradients or the weights after two optimizer steps, ``dtbook.compare.training_gap``) and the
dtypes the parallel version's outputs, parameters, gradients and optimizer state had. The test
decides what the numbers must be; nothing is asserted here. A module that fails stops the run
(the ranks could not go on in step): rank 0's last line before the traceback names it.
"""

from __future__ import annotations

import argparse
import copy
import json

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from dtbook.compare import training_gap
from dtbook.distributed import drain_gloo_workers, start_process_group
from dtbook.model import GPT, GPTConfig
from support import load_script

# Small enough to run both dtypes of every module in seconds; every split is even on 2 ranks.
CFG = GPTConfig(vocab_size=64, context=16, n_layer=2, n_head=2, n_embd=16)
BATCH = 4  # windows in the global batch
DTYPES = {"float64": torch.float64, "float32": torch.float32}


def gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return training_gap({"x": a}, {"x": b})


def dtypes(**tensors) -> dict[str, list[str]]:
    """``name -> [dtype, ...]`` of each group of tensors, for the test to read."""
    return {name: sorted({str(t.dtype).removeprefix("torch.") for t in group})
            for name, group in tensors.items()}


def gpt(dtype: torch.dtype) -> GPT:
    torch.manual_seed(0)
    return GPT(CFG).to(dtype)


def batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` global batches of token windows, the same on every rank."""
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CFG.vocab_size, (count, BATCH, CFG.context + 1), generator=generator)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def my_rows() -> slice:
    """This rank's windows of a global batch, as data parallelism cuts it."""
    per = BATCH // dist.get_world_size()
    return slice(dist.get_rank() * per, (dist.get_rank() + 1) * per)


def grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in model.named_parameters()}


def train(model, optimizer, data, rows: slice = slice(None)) -> list[dict[str, torch.Tensor]]:
    """One optimizer step per batch; the weights after each."""
    snapshots = []
    for x, y in data:
        model(x[rows], y[rows]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        snapshots.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return snapshots


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


# ----------------------------------------------------------------------------------------------
# Chapter 3: MinimalDDP's averaged gradients
# ----------------------------------------------------------------------------------------------

def minimal_ddp(dtype: torch.dtype) -> dict:
    program = load_script("ch3_minimal_ddp.py")
    [(x, y)] = batches(1)
    single = gpt(dtype)
    single(x, y).backward()
    model = gpt(dtype)
    ddp = program.MinimalDDP(model, bucket_cap_mb=0.01)  # several buckets
    loss = ddp(x[my_rows()], y[my_rows()])
    loss.backward()
    return {"gaps": {"gradients": training_gap(grads(model), grads(single))},
            "buckets": len(ddp.buckets),
            "dtypes": dtypes(output=[loss], params=model.parameters(),
                             grads=[p.grad for p in model.parameters()])}


# ----------------------------------------------------------------------------------------------
# Chapter 4: MinimalFSDP and ShardedOptimizer (ZeRO-1), two SGD steps against one process
# ----------------------------------------------------------------------------------------------

def one_process(dtype: torch.dtype, data) -> tuple[dict, dict]:
    """The reference's weights after the last step, and the controls' weights."""
    reference = gpt(dtype)
    snapshots = train(reference, sgd(reference.parameters()), data)
    other = gpt(dtype)  # the same batches in the opposite order: another training
    other_batch = train(other, sgd(other.parameters()), data[::-1])[-1]
    return snapshots[-1], {"one step fewer": snapshots[0], "batches reversed": other_batch}


def minimal_fsdp(dtype: torch.dtype) -> dict:
    program = load_script("ch4_minimal_fsdp.py")
    data = batches(2)
    reference, controls = one_process(dtype, data)
    model = gpt(dtype)
    minimal = program.MinimalFSDP(model, list(model.blocks))  # no compute dtype: the model's
    optimizer = sgd(minimal.parameters())
    for x, y in data:
        loss = minimal(x[my_rows()], y[my_rows()])
        loss.backward()
        shard_grads = [g.shard.grad for g in minimal.all_groups()]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    weights = minimal.full_state_dict()
    return {"gaps": {"weights": training_gap(weights, reference)},
            "controls": {name: training_gap(w, reference) for name, w in controls.items()},
            "dtypes": dtypes(output=[loss], params=minimal.parameters(), grads=shard_grads,
                             gathered=[g.full for g in minimal.all_groups()],
                             state_dict=weights.values())}


def sharded_optimizer(dtype: torch.dtype) -> dict:
    program = load_script("ch4_zero1.py")
    data = batches(2)
    reference, controls = one_process(dtype, data)
    ddp = DDP(gpt(dtype))
    optimizer = program.ShardedOptimizer(ddp.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    for x, y in data:
        loss = ddp(x[my_rows()], y[my_rows()])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    state = [t for s in optimizer.optimizer.state.values() for t in s.values()
             if isinstance(t, torch.Tensor)]
    return {"gaps": {"weights": training_gap(ddp.module.state_dict(), reference)},
            "controls": {name: training_gap(w, reference) for name, w in controls.items()},
            "dtypes": dtypes(output=[loss], params=ddp.parameters(), state=state)}


# ----------------------------------------------------------------------------------------------
# Chapter 8: tensor, sequence, pipeline, expert and context parallelism
# ----------------------------------------------------------------------------------------------

def tensor_parallel(dtype: torch.dtype, sequence: bool) -> dict:
    """The hand-written blocks against the unsplit GPT: logits and every weight gradient."""
    program = load_script("ch8_tensor_parallel.py")
    [(x, y)] = batches(1)
    reference = gpt(dtype)
    ref_logits, _ = program.step(reference, x, y)
    if sequence:
        model = program.hand_sequence_parallel(gpt(dtype))
        logits, _ = program.step(model, x, y, program.all_reduce_sequence_grads)
    else:
        model = program.hand_parallel(gpt(dtype))
        logits, _ = program.step(model, x, y)
    return {"gaps": {"logits": gap(logits, ref_logits),
                     "gradients": training_gap(program.full_gradients(model), grads(reference))},
            "dtypes": dtypes(output=[logits], params=model.parameters(),
                             grads=[p.grad for p in model.parameters()])}


def gpipe(dtype: torch.dtype) -> dict:
    """Two stages, two micro-batches; the reference is the GPT's own loss and backward."""
    pipeline = load_script("ch8_pipeline.py")
    [(x, y)] = batches(1)
    reference = gpt(dtype)
    reference(x, y).backward()
    tied_group = dist.new_group([0, dist.get_world_size() - 1])
    [stage] = pipeline.split_stages(gpt(dtype), dist.get_world_size(), [dist.get_rank()])
    micro = list(zip(x.chunk(2), y.chunk(2), strict=True))
    pipeline.gpipe_step(stage, micro, pipeline.Clock())
    pipeline.add_tied_gradients([stage], tied_group)
    gathered = pipeline.gathered_gradients([stage])
    return {"gaps": {"gradients": training_gap(gathered, grads(reference))},
            "dtypes": dtypes(params=stage.parameters(),
                             grads=[p.grad for p in stage.parameters()])}


def experts(dtype: torch.dtype) -> dict:
    """Four experts of width 16, 32 tokens per rank; the router's gradient summed."""
    program = load_script("ch8_experts.py")
    world, tokens = dist.get_world_size(), 32
    torch.manual_seed(0)
    reference = program.MoE(16, 4).to(dtype)
    generator = torch.Generator().manual_seed(2)
    everything = torch.randn(world * tokens, 16, generator=generator).to(dtype)
    target = torch.randn(world * tokens, 16, generator=generator).to(dtype)
    ref = copy.deepcopy(reference)
    ref_out = ref(everything)
    (ref_out * target).sum().backward()
    layer = program.ExpertParallelMoE(copy.deepcopy(reference))
    mine = slice(dist.get_rank() * tokens, (dist.get_rank() + 1) * tokens)
    out = layer(everything[mine].clone().requires_grad_())
    (out * target[mine]).sum().backward()
    for p in layer.router.parameters():
        dist.all_reduce(p.grad)
    outs = [torch.empty_like(out) for _ in range(world)]
    dist.all_gather(outs, out.detach())
    found = program.unsplit_gradients(layer)
    return {"gaps": {"outputs": gap(torch.cat(outs), ref_out),
                     "gradients": training_gap(found, grads(ref))},
            "dtypes": dtypes(output=[out], params=layer.parameters(),
                             grads=[p.grad for p in layer.parameters()])}


def ring(dtype: torch.dtype) -> dict:
    """2 heads of 8, 64 positions cut into one block per rank."""
    program = load_script("ch8_ring_attention.py")
    world, rank = dist.get_world_size(), dist.get_rank()
    generator = torch.Generator().manual_seed(3)
    q, k, v, target = (torch.randn(1, 2, 64, 8, generator=generator).to(dtype) for _ in range(4))
    full = {n: t.clone().requires_grad_() for n, t in zip("qkv", (q, k, v), strict=True)}
    ref = program.causal_attention(*full.values())
    (ref * target).sum().backward()
    block = slice(rank * 64 // world, (rank + 1) * 64 // world)
    mine = {n: t[:, :, block].clone().requires_grad_() for n, t in zip("qkv", (q, k, v), strict=True)}
    out = program.ring_attention(*mine.values())
    (out * target[:, :, block]).sum().backward()
    whole = {}
    for n, t in [("out", out.detach()), *((n, t.grad) for n, t in mine.items())]:
        pieces = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(pieces, t)
        whole[n] = torch.cat(pieces, dim=2)
    return {"gaps": {"outputs": gap(whole["out"], ref),
                     "gradients": training_gap({n: whole[n] for n in "qkv"},
                                               {n: t.grad for n, t in full.items()})},
            "dtypes": dtypes(output=[out], grads=[t.grad for t in mine.values()])}


MODULES = {
    "ch3": {"MinimalDDP": minimal_ddp},
    "ch4": {"MinimalFSDP": minimal_fsdp, "ShardedOptimizer": sharded_optimizer},
    "ch8": {"TensorParallelBlock": lambda dtype: tensor_parallel(dtype, sequence=False),
            "SequenceParallelBlock": lambda dtype: tensor_parallel(dtype, sequence=True),
            "gpipe_step": gpipe, "ExpertParallelMoE": experts, "ring_attention": ring},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("chapter", choices=sorted(MODULES))
    parser.add_argument("out", help="rank 0 writes the results here (JSON)")
    args = parser.parse_args()
    start_process_group("gloo")
    results: dict[str, dict] = {}
    for module, run in MODULES[args.chapter].items():
        for name, dtype in DTYPES.items():
            if dist.get_rank() == 0:  # the last line before a failure names its module
                print(f"{module} in {name}", flush=True)
            results.setdefault(module, {})[name] = run(dtype)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    drain_gloo_workers()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

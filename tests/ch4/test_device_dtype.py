"""MinimalFSDP and ShardedOptimizer (ZeRO-1) of section 4.2 follow the model's dtype and device.

Section 4.2 runs them in float32 (and MinimalFSDP with bf16 gathered copies) on the CPU. Here:
(a) in float64 on 2 processes, two SGD steps against one process on the whole batch: the same
training by ``dtbook.compare``'s rule, and equal to float64's resolution
(tests/dtype_worker.py); (b) a float64 model on the meta device, wrapped in this process, a
step run, every slice, gathered copy, gradient, optimizer state and communicated tensor on
meta and in float64, and a bf16 compute dtype still gathering bf16 and reducing in the
slices' dtype.
"""

import pytest
import torch

from dtbook.compare import compare_gaps
from dtbook.model import GPT, GPTConfig
from support import (
    assert_float64_agreement,
    assert_on,
    float64_runs,
    load_script,
    world_without_communication,
)

CFG = GPTConfig(vocab_size=64, context=16, n_layer=2, n_head=2, n_embd=16)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return float64_runs("ch4", tmp_path_factory.mktemp("ch4"))


@pytest.mark.parametrize("module", ["MinimalFSDP", "ShardedOptimizer"])
def test_in_float64_two_steps_train_as_one_process_does(runs, module):
    for dtype, run in runs[module].items():
        # The controls: one process one step short, and on the batches in reverse order.
        compare_gaps({f"{module} {dtype}": run["gaps"]["weights"]},
                     {f"{name} ({dtype})": gap for name, gap in run["controls"].items()},
                     steps=2)
    assert_float64_agreement(module, runs[module])


def meta_model(dtype: torch.dtype) -> GPT:
    with torch.device("meta"):
        return GPT(CFG).to(dtype)


@pytest.mark.parametrize("dtype, compute", [(torch.float64, None),
                                            (torch.float32, torch.bfloat16)])
def test_minimal_fsdp_stays_on_the_models_device_and_in_its_dtype(dtype, compute):
    program = load_script("ch4_minimal_fsdp.py")
    model = meta_model(dtype)
    x = torch.zeros(2, CFG.context, dtype=torch.long, device="meta")
    with world_without_communication(rank=0, world=2) as communicated:
        minimal = program.MinimalFSDP(model, list(model.blocks), compute)
        loss = minimal(x, x)
        loss.backward()
        state = minimal.full_state_dict()
    groups = minimal.all_groups()
    slices = [g.shard for g in groups]
    gathered = [g.full for g in groups]
    # The slices (master weights), their gradients and the state dict keep the model's dtype;
    # with a compute dtype the gathered copies take it.
    assert_on("meta", dtype, slices=slices, grads=[s.grad for s in slices if s.requires_grad],
              state_dict=state.values())
    assert_on("meta", compute or dtype, gathered=gathered)
    assert_on("meta", torch.float32 if compute else dtype, loss=[loss])
    # Communicated: rank 0's weights, the all-gathers of the slices (in the compute dtype),
    # the reduce-scatters of the gradients and the state dict's all-gathers (the slices').
    assert {(t.device.type, t.dtype) for t in communicated} == {("meta", dtype),
                                                                ("meta", compute or dtype)}


def test_sharded_optimizer_stays_on_the_models_device():
    program = load_script("ch4_zero1.py")
    model = meta_model(torch.float64)
    x = torch.zeros(2, CFG.context, dtype=torch.long, device="meta")
    with world_without_communication(rank=0, world=2) as communicated:
        optimizer = program.ShardedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1,
                                             momentum=0.9)
        model(x, x).backward()
        optimizer.step()
    state = [t for s in optimizer.optimizer.state.values() for t in s.values()
             if isinstance(t, torch.Tensor)]
    assert_on("meta", torch.float64, params=model.parameters(), momentum=state,
              broadcast=communicated)
    assert len(communicated) == 2  # one flat broadcast per owner

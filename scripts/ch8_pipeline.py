"""Pipeline parallelism: GPipe by hand over send/recv, then torch.distributed.pipelining.

    torchrun --standalone --nproc_per_node=2 scripts/ch8_pipeline.py
    torchrun --standalone --nproc_per_node=2 scripts/ch8_pipeline.py --microbatches 1 2 4 8
    torchrun --standalone --nproc_per_node=4 scripts/ch8_pipeline.py --model large
    torchrun --standalone --nproc_per_node=2 scripts/ch8_pipeline.py --time-steps 10

Each rank holds consecutive blocks of the book's GPT, a *stage*: the first stage also embeds the
tokens, the last one ends in the final LayerNorm and the head. A batch is cut into micro-batches;
a stage sends each micro-batch's activations to the next stage (dist.send / dist.recv) and, in
backward, the gradient of those activations back to the previous one. The output head is tied to
the token embedding, and these now live on the first and the last stage: after backward the two
add their gradients (an all-reduce between the two), as one process adds them in one tensor.

The script runs, on the same weights and the same batch:

1. one process's forward and backward of the whole batch (every rank computes it): the reference;
2. the hand-written GPipe schedule (all forwards, then all backwards) for each --microbatches
   count, --repeats times, recording when every forward and backward ran on every stage;
3. PipelineStage with ScheduleGPipe, Schedule1F1B and ScheduleInterleaved1F1B (two stages per
   rank) from torch.distributed.pipelining, at the largest micro-batch count.

For each it records the micro-batch losses, the gap of every weight gradient to the reference,
and the peak bytes of activations saved for backward that a rank held at once; for the
hand-written GPipe also the bytes each stage sent. --time-steps N (section 8.8) then times N
whole GPipe steps at the largest micro-batch count, the tied gradients' all-reduce included,
without the hooks that count saved bytes: the step's median and spread, and how long one
micro-batch's forward and backward took on the slowest stage.
"""

import argparse
import copy
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from dtbook.cli import ScriptError, add_backend_and_metrics, positive_int, run_main, script_parser
from dtbook.compare import training_gap
from dtbook.data import DEFAULTS, corpus_windows, first_batches
from dtbook.distributed import drain_gloo_workers, open_metrics, start_process_group
from dtbook.model import GPT, MODEL_SIZES
from dtbook.pipeline import Stage, loss_fn
from dtbook.timing import spread, time_in_turns


class Clock:
    """When this rank's forwards and backwards ran, in seconds of the system's monotonic clock
    (one clock for every process on the machine, so stages can be drawn side by side), and
    how many bytes its sends carried."""

    def __init__(self):
        self.spans: list[tuple[str, int, float, float]] = []
        self.sent_bytes = 0  # what this stage's sends carried (section 8.8)

    def run(self, kind: str, micro: int, fn):
        start = time.perf_counter()
        out = fn()
        self.spans.append((kind, micro, start, time.perf_counter()))
        return out


def gpipe_step(stage: Stage, micro: list[tuple[torch.Tensor, torch.Tensor]],
               clock: Clock, drop: int | None = None) -> list[float]:
    """GPipe: every micro-batch forward through the pipeline, then every one back.

    ``drop`` leaves out one send, the bug --drop-send reproduces."""
    rank, m = dist.get_rank(), len(micro)
    # Receive on the stage's device, in its parameters' dtype (under autocast
    # activations are bf16: torch's PipelineStage infers shape and dtype instead).
    weight = next(stage.parameters())
    inputs, outputs, losses = [], [], []
    for i, (x, y) in enumerate(micro):
        if not stage.is_first:  # micro-batch i's activations, from the stage before
            x = weight.new_empty(*y.shape, stage_width(stage))
            dist.recv(x, src=rank - 1)
            x.requires_grad_()
        out = clock.run("F", i, lambda x=x: stage(x))
        if stage.is_last:
            out = loss_fn(out, y) / m  # the batch's loss: the micro-batches' mean
            losses.append(out.item() * m)
        elif i != drop:
            dist.send(out.detach(), dst=rank + 1)
            clock.sent_bytes += out.nbytes
        inputs.append(x)
        outputs.append(out)
    for i in reversed(range(m)):
        if stage.is_last:
            clock.run("B", i, outputs[i].backward)
        else:  # the gradient of micro-batch i's output, from the next stage
            grad = torch.empty_like(outputs[i])
            dist.recv(grad, src=rank + 1)
            clock.run("B", i, lambda i=i, grad=grad: outputs[i].backward(grad))
        if not stage.is_first:
            dist.send(inputs[i].grad, dst=rank - 1)
            clock.sent_bytes += inputs[i].grad.nbytes
    return losses


def gpipe_step_or_explain(stage: Stage, micro, clock: Clock, args) -> list[float]:
    """``gpipe_step``; a transfer that never completes becomes one line, not a hang."""
    try:
        return gpipe_step(stage, micro, clock, args.drop_send)
    except RuntimeError as err:
        text, rank = str(err).lower(), dist.get_rank()
        if args.timeout is not None and "timed out" in text:
            raise ScriptError(f"stage {rank} waited {args.timeout} s for a send or recv that "
                              "its neighbour never made: every send needs its recv, in the "
                              "same order on both stages") from None
        if "closed by peer" in text:  # the neighbour gave up first and exited
            raise ScriptError(f"stage {rank} lost its neighbour in the middle of a send or "
                              "recv: that stage stopped first (see its error)") from None
        raise


def stage_width(stage: Stage) -> int:
    return next(iter(stage.blocks.values())).ln1.normalized_shape[0]


def add_tied_gradients(stages: list[Stage], group) -> None:
    """The head (last stage) and the token embedding (first stage) are one weight in
    the GPT: add their gradients, and give both stages the sum."""
    tied = [s.tok_emb.weight for s in stages if s.is_first]
    tied += [s.head.weight for s in stages if s.is_last]
    tied = list({id(p): p for p in tied}.values())  # one stage may hold both, tied
    if not tied:
        return
    total = sum(p.grad for p in tied)
    if group is not None:  # the first and the last stage live on two ranks
        dist.all_reduce(total, group=group)
    for p in tied:
        p.grad.copy_(total)


class LiveSavedBytes:
    """The bytes of activations autograd holds for backward right now, and their peak.

    The pack hook wraps each saved tensor; autograd keeps the wrapper until backward has
    used it and frees it, which tells us when the memory goes. Storages are counted
    once however many nodes save them; parameters are not activations.
    """

    def __init__(self, exclude):
        self.excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self.users: dict[int, int] = {}
        self.now = self.peak = 0

    def pack(self, tensor: torch.Tensor):
        key = tensor.untyped_storage().data_ptr()
        if key in self.excluded:
            return tensor
        if self.users.get(key, 0) == 0:
            self.now += tensor.untyped_storage().nbytes()
            self.peak = max(self.peak, self.now)
        self.users[key] = self.users.get(key, 0) + 1
        return _Held(tensor, lambda: self._release(key, tensor.untyped_storage().nbytes()))

    def _release(self, key: int, nbytes: int) -> None:
        self.users[key] -= 1
        if self.users[key] == 0:
            self.now -= nbytes

    @staticmethod
    def unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class _Held:
    """A saved tensor as autograd keeps it; ``release`` runs when autograd lets it go."""

    def __init__(self, tensor: torch.Tensor, release):
        self.tensor, self.release = tensor, release

    def __del__(self):
        self.release()


def gathered_gradients(stages: list[Stage]) -> dict[str, torch.Tensor]:
    """Every stage's gradients, on every rank, under the GPT's names."""
    mine = {name: p.grad for stage in stages for name, p in stage.named_parameters()
            if name != "head.weight"}  # the tied head: its sum is tok_emb's gradient
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {name: grad for part in everyone for name, grad in part.items()}


def split_stages(model: GPT, pieces: int, indices: list[int]) -> list[Stage]:
    """Stages ``indices`` of ``pieces``, each built from its own copy of the model:
    two stages on one rank must not share the tied weight, or PipelineStage, which
    divides each stage's gradients by the micro-batch count, divides it twice."""
    per = len(model.blocks) // pieces
    return [Stage(copy.deepcopy(model), i * per, (i + 1) * per) for i in indices]


def time_gpipe(reference: GPT, micro, steps: int, tied_group, device) -> dict:
    """--time-steps: whole GPipe steps, in the slowest stage's time, and the median
    forward and backward of one micro-batch on the slowest stage."""
    rank, world = dist.get_rank(), dist.get_world_size()
    [stage] = split_stages(copy.deepcopy(reference), world, [rank])
    clock = Clock()

    def gpipe() -> None:
        gpipe_step(stage, micro, clock)
        add_tied_gradients([stage], tied_group)
        stage.zero_grad(set_to_none=True)

    step_ms = time_in_turns({"gpipe": gpipe}, steps, 2, device)["gpipe"]
    mine = {kind: statistics.median(1000 * (end - start) for k, _, start, end
                                    in clock.spans if k == kind) for kind in "FB"}
    stages = [None] * world
    dist.all_gather_object(stages, mine)
    return {"microbatches": len(micro), "step_ms": spread(step_ms),
            "forward_ms": max(s["F"] for s in stages),
            "backward_ms": max(s["B"] for s in stages)}


def parse_args(argv=None) -> argparse.Namespace:
    parser = script_parser(__doc__)
    parser.add_argument("--model", choices=sorted(MODEL_SIZES), default="medium",
                        help="model size (default: medium, 4 blocks)")
    parser.add_argument("--batch-size", type=positive_int, default=16,
                        help="windows in the batch, cut into micro-batches (default: 16)")
    parser.add_argument("--microbatches", type=positive_int, nargs="+", default=[1, 2, 4, 8],
                        help="micro-batch counts for the hand-written GPipe (default: 1 2 4 8)")
    parser.add_argument("--repeats", type=positive_int, default=5,
                        help="GPipe steps timed per micro-batch count (default: 5)")
    parser.add_argument("--seed", type=int, default=DEFAULTS.seed)
    parser.add_argument("--drop-send", type=int, metavar="I",
                        help="a bug on purpose: the first stage never sends micro-batch I")
    parser.add_argument("--timeout", type=positive_int, metavar="SECONDS",
                        help="give up on a send or recv after this long (default: "
                             "the backend's, 30 minutes for gloo)")
    parser.add_argument("--time-steps", type=positive_int, metavar="N",
                        help="also time N GPipe steps, without the memory hooks")
    add_backend_and_metrics(parser)
    return parser.parse_args(argv)


def check_inputs(args: argparse.Namespace, world: int) -> None:
    """Refuse what cannot be cut evenly: blocks over stages, windows over micro-batches."""
    n_layer = MODEL_SIZES[args.model].n_layer
    if n_layer % world:
        raise ScriptError(f"the {args.model} model's {n_layer} blocks do not split into "
                          f"{world} stages: use a process count that divides {n_layer}")
    for m in args.microbatches:
        if args.batch_size % m:
            raise ScriptError(f"--batch-size {args.batch_size} does not split into {m} "
                              "micro-batches of equal size")
    if args.drop_send is not None and not 0 <= args.drop_send < min(args.microbatches):
        raise ScriptError(f"--drop-send {args.drop_send} is not a micro-batch: use 0 to "
                          f"{min(args.microbatches) - 1}")
    if args.time_steps and world == 1:
        raise ScriptError("--time-steps times a pipeline: launch 2 or more processes, "
                          "one per stage (torchrun --nproc_per_node=2)")
    if args.drop_send is not None and args.timeout is None:
        raise ScriptError("--drop-send hangs the pipeline: give it a --timeout")


def main() -> None:
    args = parse_args()
    check_inputs(args, int(os.environ.get("WORLD_SIZE", 1)))
    backend, device = start_process_group(args.backend, args.timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    metrics = open_metrics(args.metrics, backend, device)
    cfg = MODEL_SIZES[args.model]
    dataset = corpus_windows(args.batch_size * cfg.context + 1, cfg.vocab_size, cfg.context,
                             args.seed)
    [(x, y)] = first_batches(dataset, args.batch_size, 0, 1, args.seed, 1, device)
    torch.manual_seed(args.seed)
    reference = GPT(cfg).to(device)
    # The first and the last stage hold the tied weight; with one stage there is no pair.
    tied_group = dist.new_group([0, world - 1]) if world > 1 else None

    ref_model = copy.deepcopy(reference)
    ref_model(x, y).backward()
    ref_grads = {name: p.grad for name, p in ref_model.named_parameters()}
    m_max = max(args.microbatches)
    with torch.no_grad():
        ref_losses = [ref_model(a, b).item() for a, b in zip(x.chunk(m_max), y.chunk(m_max),
                                                              strict=True)]
    metrics.write(event="reference", losses=ref_losses, world=world, n_layer=cfg.n_layer,
                  n_embd=cfg.n_embd, context=cfg.context,
                  params=sum(p.numel() for p in reference.parameters()),
                  batch=args.batch_size)

    def record(schedule: str, m: int, stages: list[Stage], losses, live: LiveSavedBytes,
               tie: bool = True, **extra) -> None:
        if tie:  # False only in the control
            add_tied_gradients(stages, tied_group)
        grads = gathered_gradients(stages)
        peaks = [None] * world
        dist.all_gather_object(peaks, live.peak)
        losses_everywhere = [None] * world
        dist.all_gather_object(losses_everywhere, losses)
        losses = losses_everywhere[-1]  # the last stage computed them
        row = {"schedule": schedule, "microbatches": m, "losses": losses,
               "grad_gap": training_gap(grads, ref_grads), "peak_saved_bytes": peaks, **extra}
        metrics.write(event="pipeline", **row)
        if rank == 0:
            print(f"{schedule:<24} m={m}: gradient gap {row['grad_gap']:.1e}; peak saved "
                  f"activations per rank {[f'{p / 2**20:.2f} MiB' for p in peaks]}")

    # 2. GPipe by hand, for every micro-batch count.
    for m in args.microbatches:
        micro = list(zip(x.chunk(m), y.chunk(m), strict=True))
        for repeat in range(args.repeats):
            model = copy.deepcopy(reference)
            [stage] = split_stages(model, world, [rank])
            clock, live = Clock(), LiveSavedBytes(stage.parameters())
            dist.barrier()  # every stage starts the step together
            with live.hooks():
                losses = gpipe_step_or_explain(stage, micro, clock, args)
            spans = [None] * world
            dist.all_gather_object(spans, clock.spans)
            if repeat == args.repeats - 1:
                mine = {"sent_bytes": clock.sent_bytes,
                        "params": sum(p.numel() for p in stage.parameters())}
                per_stage = [None] * world  # what each stage's sends carried and holds
                dist.all_gather_object(per_stage, mine)
                record("GPipe by hand", m, [stage], losses, live, spans=spans,
                       sent_bytes=[r["sent_bytes"] for r in per_stage],
                       stage_params=[r["params"] for r in per_stage])
            elif m == m_max and repeat == 0:  # the control: the tied gradients not added
                record("control: tied grads not added", m, [stage], losses, live, False,
                       spans=spans)
            else:  # the gradients are the same every time; only the timings differ
                metrics.write(event="timeline", microbatches=m, spans=spans)

    # 3. torch.distributed.pipelining at the largest micro-batch count.
    for name, schedule_class, per_rank in [("ScheduleGPipe", ScheduleGPipe, 1),
                                           ("Schedule1F1B", Schedule1F1B, 1),
                                           ("ScheduleInterleaved1F1B",
                                            ScheduleInterleaved1F1B, 2)]:
        pieces = world * per_rank
        if cfg.n_layer % pieces or (per_rank > 1 and m_max % world):
            continue  # not enough blocks for two stages per rank, or uneven rounds
        model = copy.deepcopy(reference)
        indices = list(range(rank, pieces, world))  # rank r: stages r, r + world, ...
        stages = split_stages(model, pieces, indices)
        pipeline_stages = [PipelineStage(s, i, pieces, device) for s, i in zip(stages, indices,
                                                                               strict=True)]
        if per_rank == 1:
            schedule = schedule_class(pipeline_stages[0], m_max, loss_fn=loss_fn)
        else:
            schedule = schedule_class(pipeline_stages, m_max, loss_fn=loss_fn)
        live = LiveSavedBytes([p for s in stages for p in s.parameters()])
        losses = []
        inputs = (x,) if rank == 0 else ()  # the first stage takes the batch,
        targets = {"target": y, "losses": losses} if rank == world - 1 else {}  # the last
        with live.hooks():
            schedule.step(*inputs, **targets)
        record(name, m_max, stages, [t.item() for t in losses], live)
    if args.time_steps:
        micro = list(zip(x.chunk(m_max), y.chunk(m_max), strict=True))
        timing = time_gpipe(reference, micro, args.time_steps, tied_group, device)
        metrics.write(event="timing", **timing)
        if rank == 0:
            t = timing["step_ms"]
            print(f"GPipe m={m_max}: {t['median']:.1f} ms per step (p25-p75 "
                  f"{t['p25']:.1f}-{t['p75']:.1f}); one micro-batch on the slowest stage: "
                  f"forward {timing['forward_ms']:.1f} ms, backward "
                  f"{timing['backward_ms']:.1f} ms")
    metrics.close()
    drain_gloo_workers()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)

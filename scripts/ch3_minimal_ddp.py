"""DDP from scratch, next to the real thing: same data, same start, same gradients.

    torchrun --standalone --nproc_per_node=2 scripts/ch3_minimal_ddp.py
    python scripts/ch3_minimal_ddp.py            # a world of one, no launcher

MinimalDDP below does what torch.nn.parallel.DistributedDataParallel does, in a
page: broadcast rank 0's weights at construction, group parameters into buckets
in reverse order, and, as soon as autograd has produced all of a bucket's
gradients, scale them by 1/world_size while copying them into the bucket and
all-reduce (sum) the bucket asynchronously; when backward ends, wait and copy
the averages back into .grad. The script then

1. builds a deliberately different model on every rank and measures how far
   each rank is from rank 0 before and after wrapping (MinimalDDP and DDP);
2. runs a few backward passes through MinimalDDP, DDP and a one-process model
   that sees the whole global batch, and compares the three gradients;
3. wraps the model in DDP with several ``bucket_cap_mb`` values and records the
   buckets DDP actually all-reduced (through a communication hook) and what
   ``_get_ddp_logging_data()`` reports;
4. checks where DDP divides by the world size: its averaged gradient against the
   same all-reduce with the division placed before the sum and after it, bit
   for bit (the two orders differ from 3 processes on).
"""

import argparse
import copy
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd import Variable
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.futures import Future
from torch.nn.parallel import DistributedDataParallel as DDP

from dtbook.cli import (
    ScriptError,
    add_backend_and_metrics,
    positive_float,
    positive_int,
    run_main,
    script_parser,
)
from dtbook.data import TokenWindows, synthetic_corpus
from dtbook.distributed import ddp_device_ids, drain_gloo_workers, open_metrics, start_process_group
from dtbook.model import GPT, MODEL_SIZES


class MinimalDDP(nn.Module):
    """Data parallelism in a page: replicate, hook, bucket, scale, all-reduce."""

    def __init__(self, module: nn.Module, bucket_cap_mb: float):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()

        # Every rank must start from the same weights, or the replicas drift apart.
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor, src=0)

        # Backward produces gradients roughly in reverse order of definition, so the
        # buckets are filled from the last parameter backwards; a bucket closes once
        # it holds the cap.
        cap_bytes = bucket_cap_mb * 2**20
        self.buckets: list[list[nn.Parameter]] = [[]]
        filled = 0
        for param in reversed([p for p in module.parameters() if p.requires_grad]):
            if filled >= cap_bytes:
                self.buckets.append([])
                filled = 0
            self.buckets[-1].append(param)
            filled += param.numel() * param.element_size()
        self.bucket_of = {p: i for i, b in enumerate(self.buckets) for p in b}

        # Autograd calls the hook the moment a parameter's .grad is final.
        for param in self.bucket_of:
            param.register_post_accumulate_grad_hook(self._grad_ready)
        self._start_new_backward()
        self.launches: list[dict] = []  # when each bucket left, to show the overlap

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _start_new_backward(self) -> None:
        self.grads_ready = 0
        self.ready_in_bucket = [0] * len(self.buckets)
        self.next_bucket = 0
        self.in_flight: list[tuple[list[nn.Parameter], torch.Tensor, dist.Work]] = []

    def _grad_ready(self, param: nn.Parameter) -> None:
        if self.grads_ready == 0:
            # The first gradient of this backward: run _finish when autograd is done.
            Variable._execution_engine.queue_callback(self._finish)
            self.launches = []
        self.grads_ready += 1
        self.ready_in_bucket[self.bucket_of[param]] += 1
        # Launch complete buckets strictly in bucket order: every rank must issue the
        # same all-reduces in the same order, whatever order its hooks fired in.
        while (self.next_bucket < len(self.buckets)
               and self.ready_in_bucket[self.next_bucket]
               == len(self.buckets[self.next_bucket])):
            bucket = self.buckets[self.next_bucket]
            # Like DDP: scale by 1/world_size while copying into the bucket, then
            # sum. A sum of scaled values is no larger than one gradient, so it
            # cannot overflow where the plain sum of world_size gradients could.
            flat = torch.cat([p.grad.reshape(-1) for p in bucket])
            flat.mul_(1 / self.world_size)
            work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, async_op=True)
            self.in_flight.append((bucket, flat, work))
            self.launches.append({"bucket": self.next_bucket,
                                  "grads_ready": self.grads_ready})
            self.next_bucket += 1

    def _finish(self) -> None:
        if self.next_bucket < len(self.buckets):
            raise RuntimeError("some parameters got no gradient in this backward "
                               "pass, so their bucket never filled; real DDP needs "
                               "find_unused_parameters=True for such models")
        for bucket, flat, work in self.in_flight:
            work.wait()  # flat now holds the mean over ranks
            sizes = [p.numel() for p in bucket]
            for param, grad in zip(bucket, flat.split(sizes), strict=True):
                param.grad.copy_(grad.view_as(param))
        self._start_new_backward()


def distance_from_rank0(module: nn.Module) -> float:
    """max |w_this_rank - w_rank0| over every parameter and buffer."""
    tensors = [*module.parameters(), *module.buffers()]
    mine = torch.cat([t.detach().reshape(-1).float() for t in tensors])
    rank0 = mine.clone()
    dist.broadcast(rank0, src=0)
    return (mine - rank0).abs().max().item()


def max_abs_diff(grads_a: list[torch.Tensor], grads_b: list[torch.Tensor]) -> float:
    """Largest elementwise gap between two gradient lists, the maximum over ranks."""
    pairs = zip(grads_a, grads_b, strict=True)
    gap = torch.stack([(a - b).abs().max() for a, b in pairs]).max()
    dist.all_reduce(gap, op=dist.ReduceOp.MAX)
    return gap.item()


def gradient_counter(module: nn.Module) -> list[int]:
    """A one-element list that counts gradients as autograd finalizes them."""
    count = [0]

    def bump(_param: nn.Parameter) -> None:
        count[0] += 1

    for param in module.parameters():
        param.register_post_accumulate_grad_hook(bump)
    return count


def record_buckets(log: list[dict], ready_counter: list[int], param_index: dict):
    """A comm hook that notes which parameters a bucket holds, then all-reduces."""

    def hook(process_group, bucket: dist.GradBucket) -> Future[torch.Tensor]:
        log.append({
            "bucket": bucket.index(),
            "param_indices": [param_index[p] for p in bucket.parameters()],
            "numel": bucket.buffer().numel(),
            "bytes": bucket.buffer().numel() * bucket.buffer().element_size(),
            "grads_ready": ready_counter[0],
        })
        return default_hooks.allreduce_hook(process_group, bucket)

    return hook


def division_order(model: nn.Module, inputs, targets, device) -> dict:
    """Where does DDP divide by the world size? Its average against both orders.

    A fresh DDP all-reduces its first backward as one bucket that holds every
    gradient in definition order, so the same flat tensor can be all-reduced here
    with the division placed before the sum and after it, and compared bit for bit.
    """
    world_size = dist.get_world_size()
    ddp = DDP(copy.deepcopy(model), device_ids=ddp_device_ids(device))
    params = list(ddp.module.parameters())
    local = {}  # this rank's own gradients, caught before DDP writes the average

    def keep_local(param: nn.Parameter) -> None:
        local[param] = param.grad.clone()

    for param in params:
        param.register_post_accumulate_grad_hook(keep_local)
    ddp(inputs, targets).backward()
    averaged = torch.cat([p.grad.reshape(-1) for p in params])
    mine = torch.cat([local[p].reshape(-1) for p in params])

    scale_first = mine * (1 / world_size)  # DDP's order: scale, then sum
    dist.all_reduce(scale_first)
    sum_first = mine.clone()  # the other order: sum, then divide
    dist.all_reduce(sum_first)
    sum_first /= world_size

    def differing(a: torch.Tensor, b: torch.Tensor) -> int:
        return int((a != b).sum())

    return {"world_size": world_size, "elements": averaged.numel(),
            "ddp_vs_scale_first": differing(averaged, scale_first),
            "ddp_vs_sum_first": differing(averaged, sum_first),
            "scale_first_vs_sum_first": differing(scale_first, sum_first),
            "max_gap": (scale_first - sum_first).abs().max().item(),
            "largest": averaged.abs().max().item()}


def parse_caps(text: str) -> list[float]:
    try:
        caps = [positive_float(part) for part in text.split(",")]
    except argparse.ArgumentTypeError as err:
        raise argparse.ArgumentTypeError(
            f"bucket caps must be comma-separated positive MiB values: {err}"
        ) from None
    return caps


def parse_args() -> argparse.Namespace:
    parser = script_parser(__doc__)
    add = parser.add_argument
    add("--model", choices=sorted(MODEL_SIZES), default="small",
        help="model size (default: small)")
    add("--batch-size", type=positive_int, default=4,
        help="sequences per process per step")
    add("--steps", type=positive_int, default=2,
        help="backward passes to compare (DDP rebuilds its buckets after the first)")
    add("--bucket-cap-mb", type=positive_float, default=0.05,
        help="bucket size for MinimalDDP and the DDP it is compared with (MiB)")
    add("--layout-caps-mb", type=parse_caps, default=[0.05, 0.25, 25.0],
        help="bucket_cap_mb values whose DDP bucket layout to record "
             "(comma-separated MiB)")
    add("--seed", type=int, default=0)
    add("--save-gradients", metavar="PATH",
        help="rank 0 saves the last step's three gradients here (torch.save)")
    add_backend_and_metrics(parser)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    folder = Path(args.save_gradients or ".").resolve().parent
    if args.save_gradients and not os.access(folder, os.W_OK):
        raise ScriptError(f"--save-gradients {args.save_gradients}: its directory "
                          "does not exist or is not writable")
    backend, device = start_process_group(args.backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    metrics = open_metrics(args.metrics, backend, device)
    cfg = MODEL_SIZES[args.model]
    device_ids = ddp_device_ids(device)

    # 1. Replication. Seeding with the rank gives every process a different init.
    torch.manual_seed(args.seed + rank)
    model = GPT(cfg).to(device)
    before = distance_from_rank0(model)
    minimal = MinimalDDP(model, args.bucket_cap_mb)
    after = distance_from_rank0(model)

    torch.manual_seed(args.seed + rank)
    fresh = GPT(cfg).to(device)
    ddp_before = distance_from_rank0(fresh)
    ddp = DDP(fresh, bucket_cap_mb=args.bucket_cap_mb, device_ids=device_ids)
    ddp_after = distance_from_rank0(ddp.module)
    pairs = zip(model.parameters(), ddp.module.parameters(), strict=True)
    same_start = max((p - q).abs().max().item() for p, q in pairs)
    everyone = [None] * world_size
    mine = {"rank": rank, "before": before, "after_minimal": after,
            "ddp_before": ddp_before, "after_ddp": ddp_after,
            "minimal_vs_ddp_weights": same_start}
    dist.all_gather_object(everyone, mine)
    for row in everyone:
        metrics.write(event="replication", **row)
    if rank == 0:
        for row in everyone:
            print(f"rank {row['rank']}: max|w - w_rank0| before wrapping "
                  f"{row['before']:.3g}, after MinimalDDP "
                  f"{row['after_minimal']:.3g}, after DDP {row['after_ddp']:.3g}")

    # 2. Gradients. Rank r takes its own slice of each global batch; the one-process
    # reference takes the whole global batch, as one big machine would.
    single = copy.deepcopy(model)  # a plain model: deepcopy drops MinimalDDP's hooks
    global_batch = args.batch_size * world_size
    num_tokens = args.steps * global_batch * cfg.context + 1
    tokens = synthetic_corpus(num_tokens, cfg.vocab_size, args.seed)
    windows = TokenWindows(tokens, cfg.context)
    names = [name for name, _ in model.named_parameters()]
    param_index = {p: i for i, p in enumerate(model.parameters())}
    metrics.write(event="model", names=names,
                  numels=[p.numel() for p in model.parameters()],
                  bytes=[p.numel() * p.element_size() for p in model.parameters()],
                  minimal_buckets=[[param_index[p] for p in bucket]
                                   for bucket in minimal.buckets])
    for step in range(args.steps):
        first = step * global_batch
        batch = [windows[i] for i in range(first, first + global_batch)]
        inputs = torch.stack([x for x, _ in batch]).to(device)
        targets = torch.stack([y for _, y in batch]).to(device)
        mine = slice(rank * args.batch_size, (rank + 1) * args.batch_size)

        for net in (minimal, ddp):
            net.zero_grad(set_to_none=True)
            net(inputs[mine], targets[mine]).backward()
        single.zero_grad(set_to_none=True)
        single(inputs, targets).backward()

        grads = {name: [p.grad for p in net.parameters()] for name, net in
                 (("minimal", minimal), ("ddp", ddp), ("single", single))}
        minimal_vs_ddp = max_abs_diff(grads["minimal"], grads["ddp"])
        ddp_vs_single = max_abs_diff(grads["ddp"], grads["single"])
        record = {
            "event": "gradients", "step": step,
            "max_diff_minimal_vs_ddp": minimal_vs_ddp,
            "max_diff_ddp_vs_single_process": ddp_vs_single,
            "max_abs_grad": max(g.abs().max().item() for g in grads["ddp"]),
            "minimal_launches": minimal.launches,
        }
        metrics.write(**record)
        if rank == 0:
            print(f"step {step}: max|g_minimal - g_ddp| = "
                  f"{record['max_diff_minimal_vs_ddp']:.3g}, "
                  f"max|g_ddp - g_one_process| = "
                  f"{record['max_diff_ddp_vs_single_process']:.3g} "
                  f"(largest gradient entry {record['max_abs_grad']:.3g})")
    if args.save_gradients and rank == 0:
        saved = {k: [g.cpu() for g in v] for k, v in grads.items()}
        torch.save({"names": names, **saved}, args.save_gradients)

    # 3. The buckets DDP really used. A post-accumulate hook counts gradients as they
    # appear, so a bucket's record says how much of backward was done when it left.
    for cap in args.layout_caps_mb:
        probe = DDP(copy.deepcopy(model), bucket_cap_mb=cap, device_ids=device_ids)
        pairs = zip(probe.module.parameters(), model.parameters(), strict=True)
        index_of = {p: param_index[q] for p, q in pairs}
        ready = gradient_counter(probe.module)
        log: list[dict] = []
        probe.register_comm_hook(None, record_buckets(log, ready, index_of))
        for iteration in range(3):  # DDP rebuilds its buckets after iteration 0
            log.clear()
            ready[0] = 0
            probe(inputs[mine], targets[mine]).backward()
            metrics.write(event="ddp_buckets", bucket_cap_mb=cap,
                          iteration=iteration, total_grads=len(param_index),
                          buckets=sorted(log, key=lambda b: b["bucket"]))
        logging_data = probe._get_ddp_logging_data()
        fields = ("bucket_cap_bytes", "bucket_sizes", "rebuilt_bucket_sizes",
                  "rebuilt_per_bucket_param_indices",
                  "prev_iteration_grad_ready_order_indices", "has_rebuilt_buckets")
        metrics.write(event="ddp_logging_data", bucket_cap_mb=cap,
                      **{k: logging_data.get(k) for k in fields})
        if rank == 0:
            sizes = [b["numel"] for b in sorted(log, key=lambda b: b["bucket"])]
            print(f"bucket_cap_mb={cap:g}: DDP all-reduced {len(log)} bucket(s) of "
                  f"{sizes} elements")

    # 4. Where the division happens, seen in the bits of the result.
    order = division_order(model, inputs[mine], targets[mine], device)
    metrics.write(event="division_order", **order)
    if rank == 0:
        print(f"of {order['elements']:,} averaged gradient entries, "
              f"{order['ddp_vs_scale_first']} differ from scale-then-sum and "
              f"{order['ddp_vs_sum_first']} from sum-then-divide")
    metrics.close()
    drain_gloo_workers()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)

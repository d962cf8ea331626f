"""What does find_unused_parameters=True cost per DDP step? A table of measured step times.

    torchrun --standalone --nproc_per_node=2 scripts/ch3_find_unused_cost.py
    torchrun --standalone --nproc_per_node=2 scripts/ch3_find_unused_cost.py --model small --steps 40

Three DDP replicas of the same GPT (every parameter used, so all three settings work):
the default, find_unused_parameters=True (after every forward DDP walks the autograd
graph from the outputs to find parameters that will get no gradient), and
static_graph=True (DDP records the graph once and reuses what it learned). Their steps
are interleaved — one step of each in turn — so a burst of load from elsewhere on the
machine hits all three alike. The table reports the median and the spread of step times.
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from dtbook.cli import add_backend_and_metrics, positive_int, run_main, script_parser
from dtbook.data import synthetic_corpus
from dtbook.distributed import ddp_device_ids, drain_gloo_workers, open_metrics, start_process_group
from dtbook.model import GPT, MODEL_SIZES

SETTINGS = {
    "default": {},
    "find_unused_parameters": {"find_unused_parameters": True},
    "static_graph": {"static_graph": True},
}


def parse_args() -> argparse.Namespace:
    parser = script_parser(__doc__)
    parser.add_argument("--model", choices=sorted(MODEL_SIZES), default="tiny", help="GPT size (default tiny)")
    parser.add_argument("--steps", type=positive_int, default=30, help="timed steps per setting (default 30)")
    parser.add_argument("--warmup", type=positive_int, default=3, help="untimed steps per setting first (default 3)")
    parser.add_argument("--batch-size", type=positive_int, default=8, help="sequences per process (default 8)")
    parser.add_argument("--seed", type=int, default=0)
    add_backend_and_metrics(parser)
    return parser.parse_args()


def autograd_nodes(loss: torch.Tensor) -> int:
    """The nodes of the backward graph of ``loss``: what find_unused_parameters
    walks every step."""
    seen, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return len(seen)


def main() -> None:
    args = parse_args()
    backend, device = start_process_group(args.backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    metrics = open_metrics(args.metrics, backend, device)

    cfg = MODEL_SIZES[args.model]
    replicas = {}
    for name, options in SETTINGS.items():
        torch.manual_seed(args.seed)  # the same initial weights for every setting
        model = GPT(cfg).to(device)
        replicas[name] = (
            DDP(model, device_ids=ddp_device_ids(device), **options),
            torch.optim.AdamW(model.parameters(), lr=1e-3),
        )

    tokens = synthetic_corpus(50_000, cfg.vocab_size, seed=args.seed)
    generator = torch.Generator().manual_seed(args.seed + rank)

    def batch():
        starts = torch.randint(0, len(tokens) - cfg.context - 1, (args.batch_size,), generator=generator)
        idx = torch.stack([tokens[s : s + cfg.context] for s in starts])
        targets = torch.stack([tokens[s + 1 : s + cfg.context + 1] for s in starts])
        return idx.to(device), targets.to(device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times = {name: [] for name in SETTINGS}
    nodes = None
    for step in range(args.warmup + args.steps):
        idx, targets = batch()
        for name, (ddp_model, optimizer) in replicas.items():
            sync()
            start = time.perf_counter()
            loss = ddp_model(idx, targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            sync()
            if step >= args.warmup:
                times[name].append(time.perf_counter() - start)
            nodes = nodes or autograd_nodes(loss)

    # The settings change how DDP finds ready gradients, not the arithmetic: the replicas must still agree.
    reference = [p.detach() for p in replicas["default"][0].parameters()]
    weight_difference = max(
        (p.detach() - q).abs().max().item()
        for ddp_model, _ in replicas.values()
        for p, q in zip(ddp_model.parameters(), reference, strict=True)
    )

    baseline = statistics.median(times["default"])
    if rank == 0:
        print(f"GPT {args.model}: {sum(p.numel() for p in model.parameters()):,} parameters, "
              f"{nodes} autograd nodes per step; {args.steps} timed steps per setting, {world_size} processes")
        print(f"{'setting':<24}{'median ms':>10}{'p10 ms':>9}{'p90 ms':>9}{'vs default':>12}")
    for name, samples in times.items():
        deciles = statistics.quantiles(samples, n=10)
        median = statistics.median(samples)
        record = dict(event="setting", setting=name, median_s=median, p10_s=deciles[0], p90_s=deciles[-1],
                      relative=median / baseline, steps=len(samples))
        metrics.write(**record)
        if rank == 0:
            print(f"{name:<24}{median * 1e3:>10.2f}{deciles[0] * 1e3:>9.2f}{deciles[-1] * 1e3:>9.2f}"
                  f"{median / baseline:>11.2f}x")
    if rank == 0:
        print(f"largest weight difference between the settings after {args.warmup + args.steps} steps: "
              f"{weight_difference:.3g}")
    metrics.write(event="summary", model=args.model, autograd_nodes=nodes, steps=args.steps,
                  weight_difference=weight_difference,
                  times_s={name: samples for name, samples in times.items()})
    metrics.close()
    drain_gloo_workers()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)

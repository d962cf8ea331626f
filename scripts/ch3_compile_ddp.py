"""torch.compile on a DDP model: the graph is cut at bucket boundaries, same result.

    torchrun --standalone --nproc_per_node=2 scripts/ch3_compile_ddp.py
    torchrun --standalone --nproc_per_node=2 scripts/ch3_compile_ddp.py \\
        --compiler aot_eager

Compiling a DDP model in one piece would turn the whole backward pass into one
compiled function whose gradients all appear at its end: DDP's hooks would fire only
then, and no all-reduce could overlap the backward pass. TorchDynamo's DDPOptimizer
therefore splits the captured graph at DDP's bucket boundaries and compiles each
piece separately, so that a bucket's gradients are ready, and its all-reduce can
start, while the pieces before it are still computing. This script counts the pieces
the compiler was handed, with the DDPOptimizer on and off, on a model of --layers
equal layers of 1 MiB each (with a 1 MiB bucket cap: one layer per bucket), and
compares the gradients and weights with those of eager DDP.

--compiler inductor (the default where a C++ compiler is found) generates and
compiles C++ kernels, which takes a while on a CPU; aot_eager runs the captured
graphs with PyTorch's own kernels and needs no compiler.
"""

import argparse
import shutil
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from dtbook.cli import (
    ScriptError,
    add_backend_and_metrics,
    positive_int,
    run_main,
    script_parser,
)
from dtbook.ddp_inspect import bucket_sizes
from dtbook.distributed import ddp_device_ids, drain_gloo_workers, open_metrics, start_process_group

WIDTH = 512  # a 512 x 512 float32 weight is 1 MiB: one layer per 1 MiB bucket
BUCKET_CAP_MB = 1.0  # the DDPOptimizer refuses caps below DDP's 1 MiB first bucket


class LayerStack(nn.Module):
    """Equal Linear + ReLU layers, so that the buckets are easy to count."""

    def __init__(self, layers: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def parse_args() -> argparse.Namespace:
    parser = script_parser(__doc__)
    add = parser.add_argument
    add("--layers", type=positive_int, default=6, help="layers of 1 MiB (default 6)")
    add("--steps", type=positive_int, default=3,
        help="training steps compared (default 3)")
    add("--compiler", choices=["auto", "inductor", "aot_eager"], default="auto",
        help="torch.compile backend (default: inductor if a C++ compiler is found)")
    add("--seed", type=int, default=0)
    add_backend_and_metrics(parser)
    args = parser.parse_args()
    has_compiler = any(shutil.which(cc) for cc in ("g++", "c++", "clang++"))
    if args.compiler == "auto":
        args.compiler = "inductor" if has_compiler else "aot_eager"
    elif args.compiler == "inductor" and not has_compiler:
        raise ScriptError("--compiler inductor needs a C++ compiler (g++ or clang++) "
                          "on the PATH; install one or use --compiler aot_eager")
    return args


def counting(compiler: str, pieces: list[int]):
    """A compile backend that counts the graphs it is handed, then compiles each."""
    inner = torch._dynamo.lookup_backend(compiler)

    def backend(graph: torch.fx.GraphModule, example_inputs):
        pieces.append(sum(node.op == "call_module" or node.op == "call_function"
                          for node in graph.graph.nodes))
        return inner(graph, example_inputs)

    return backend


def train(model: nn.Module, x: torch.Tensor, steps: int) -> tuple[list, list]:
    """SGD steps on one batch; the last step's gradients and the final weights."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        optimizer.zero_grad()
        model(x).square().mean().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        optimizer.step()
    return grads, [p.detach().clone() for p in model.parameters()]


def largest_gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def main() -> None:
    args = parse_args()
    backend, device = start_process_group(args.backend)
    rank = dist.get_rank()
    metrics = open_metrics(args.metrics, backend, device)
    data = torch.Generator().manual_seed(rank)  # a different batch on every rank
    x = torch.randn(16, WIDTH, generator=data).to(device)

    def ddp_model() -> DDP:
        torch.manual_seed(args.seed)
        model = LayerStack(args.layers).to(device)
        return DDP(model, device_ids=ddp_device_ids(device),
                   bucket_cap_mb=BUCKET_CAP_MB)

    eager = ddp_model()
    eager_grads, eager_weights = train(eager, x, args.steps)
    buckets = len(bucket_sizes(eager))  # as rebuilt after the first step

    for optimize_ddp in (True, False):
        # On (the default): DDPOptimizer splits the graph at bucket boundaries.
        torch._dynamo.config.optimize_ddp = optimize_ddp
        torch._dynamo.reset()
        pieces: list[int] = []
        compiled = torch.compile(ddp_model(),
                                 backend=counting(args.compiler, pieces))
        start = time.perf_counter()
        grads, weights = train(compiled, x, args.steps)
        record = {"optimize_ddp": optimize_ddp, "compiler": args.compiler,
                  "buckets": buckets, "graphs": len(pieces), "ops_per_graph": pieces,
                  "seconds": time.perf_counter() - start,
                  "grad_gap": largest_gap(grads, eager_grads),
                  "weight_gap": largest_gap(weights, eager_weights),
                  "largest_grad": max(g.abs().max().item() for g in eager_grads)}
        metrics.write(event="compiled", **record)
        if rank == 0:
            print(f"optimize_ddp={optimize_ddp}: {args.compiler} compiled "
                  f"{len(pieces)} graph(s) {pieces} for {buckets} bucket(s) in "
                  f"{record['seconds']:.1f} s; largest gap to eager DDP: gradients "
                  f"{record['grad_gap']:.3g}, weights {record['weight_gap']:.3g}")
    metrics.close()
    drain_gloo_workers()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)

"""Gradient accumulation on one device: a large batch from micro-batches, and the averaging bug.

    python scripts/ch1_accumulation.py
    python scripts/ch1_accumulation.py --model medium --micro-batch-size 4 --accum-steps 8
    torchrun --standalone --nproc_per_node=1 scripts/ch1_accumulation.py

backward() adds into .grad, so k backward passes before one optimizer step sum k gradients. If
micro-batch i holds n_i of the N windows and its loss is the mean over its windows, the large
batch's mean loss is sum_i (n_i / N) * loss_i: that weight, not 1/k, is what each micro-batch's
loss must be multiplied by. They are the same only when every micro-batch has the same size.

1. gradients  each way of splitting a batch, with each weighting, against the gradient of the
              whole batch in one pass: equal micro-batches weighted 1/k, unequal ones weighted 1/k
              (the classic bug) and n_i/N, and a short last group at the end of an epoch divided by
              the planned --accum-steps (the bug) or weighted n_i/N
2. ranks      the same batch split over --ranks data-parallel ranks, simulated in one process:
              each rank accumulates its share, then the gradients are averaged over the ranks as
              DDP's all-reduce does; n_i over the rank's own windows is right, n_i over the global
              batch (the bug) gives a gradient --ranks times too small
3. training   --train-steps optimizer steps with the whole batch and with accumulation: the loss
              of every step, the bytes saved for backward at once (SavedTensors) and step times
"""

import argparse

import torch
import torch.distributed as dist

from dtbook.cli import add_backend_and_metrics, positive_int, run_main, script_parser
from dtbook.data import DEFAULTS, corpus_windows, first_batches
from dtbook.distributed import drain_gloo_workers, open_metrics, start_single_device
from dtbook.measure import SavedTensors, median_ms
from dtbook.model import GPT, MODEL_SIZES


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = script_parser(__doc__)
    add = parser.add_argument
    add("--model", choices=sorted(MODEL_SIZES), default="small", help="model size (default: small)")
    add("--micro-batch-size", type=positive_int, default=4, help="windows per micro-batch (default: 4)")
    add("--accum-steps", type=positive_int, default=4, help="micro-batches per optimizer step (default: 4)")
    add("--last-micro-batch", type=positive_int, default=2,
        help="size of the smaller last micro-batch in the unequal split (default: 2)")
    add("--ranks", type=positive_int, default=2,
        help="data-parallel ranks simulated in one process (default: 2)")
    add("--train-steps", type=positive_int, default=10, help="optimizer steps of the training run (default: 10)")
    add("--seed", type=int, default=DEFAULTS.seed, help="seeds the corpus and the weights")
    add_backend_and_metrics(parser)
    args = parser.parse_args(argv)
    if args.accum_steps < 2:
        parser.error("--accum-steps must be at least 2: one micro-batch accumulates nothing")
    if args.last_micro_batch >= args.micro_batch_size:
        parser.error(f"--last-micro-batch ({args.last_micro_batch}) must be smaller than "
                     f"--micro-batch-size ({args.micro_batch_size}) to make the split unequal")
    if (args.micro_batch_size * args.accum_steps) % args.ranks:
        parser.error(f"--ranks ({args.ranks}) must divide the batch of "
                     f"{args.micro_batch_size * args.accum_steps} windows")
    return args


def mean_loss_weights(sizes: list[int]) -> list[float]:
    """What turns micro-batch mean losses into the mean over all windows: n_i / N."""
    return [n / sum(sizes) for n in sizes]


def accumulated_gradients(model, x, y, sizes: list[int],
                          weights: list[float]) -> list[torch.Tensor]:
    """Split (x, y) into micro-batches of ``sizes``, backward each weighted mean
    loss.

    Nothing resets .grad between the backward passes, so it ends up holding their
    sum.
    """
    model.zero_grad(set_to_none=True)
    for xs, ys, weight in zip(x.split(sizes), y.split(sizes), weights, strict=True):
        (model(xs, ys) * weight).backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def splits(args) -> list[dict]:
    """Each way of splitting one batch, with each weighting, and whether it is
    right."""
    m, k = args.micro_batch_size, args.accum_steps
    equal = [m] * k
    unequal = [m] * (k - 1) + [args.last_micro_batch]
    # an epoch that ends halfway through an accumulation group
    short = [m] * (k // 2)

    def case(name, sizes, weights, right):
        return {"case": name, "sizes": sizes, "weights": weights, "right": right}

    right = mean_loss_weights
    return [
        case("equal micro-batches, loss / k", equal, [1 / k] * k, True),
        case("unequal micro-batches, loss / k", unequal, [1 / k] * k, False),
        case("unequal micro-batches, loss x n_i / N", unequal, right(unequal), True),
        case("short last group, loss / accum-steps", short, [1 / k] * len(short),
             False),
        case("short last group, loss x n_i / N", short, right(short), True),
    ]


def compare_splits(args, model, x, y) -> list[dict]:
    rows = []
    for split in splits(args):
        n = sum(split["sizes"])
        whole = accumulated_gradients(model, x[:n], y[:n], [n], [1.0])
        accumulated = accumulated_gradients(model, x[:n], y[:n], split["sizes"], split["weights"])
        rows.append({**split, "windows": n,
                     "max_abs_difference": max((a - w).abs().max().item()
                                               for a, w in zip(accumulated, whole, strict=True)),
                     "max_abs_gradient": max(w.abs().max().item() for w in whole)})
    return rows


def data_parallel_gradients(model, x, y, ranks: int, micro_batch_size: int,
                            per_rank: bool) -> list[torch.Tensor]:
    """``ranks`` data-parallel ranks, simulated one after the other: each accumulates
    its share of (x, y) in micro-batches, then the gradients are averaged over the
    ranks, as DDP's all-reduce (a sum, divided by the world size) does.

    ``per_rank``: weight n_i by the rank's own windows; otherwise by the global batch.
    """
    per_rank_grads = []
    for xs, ys in zip(x.chunk(ranks), y.chunk(ranks), strict=True):
        sizes = [len(micro) for micro in xs.split(micro_batch_size)]
        windows = sum(sizes) if per_rank else len(x)
        per_rank_grads.append(accumulated_gradients(model, xs, ys, sizes,
                                                    [n / windows for n in sizes]))
    return [torch.stack(g).sum(0) / ranks for g in zip(*per_rank_grads, strict=True)]


def compare_data_parallel(args, model, x, y) -> list[dict]:
    whole = accumulated_gradients(model, x, y, [len(x)], [1.0])
    rows = []
    for per_rank, name in ((True, "n_i / N of the rank"), (False, "n_i / N of the global batch")):
        grads = data_parallel_gradients(model, x, y, args.ranks, args.micro_batch_size, per_rank)
        rows.append({"case": name, "right": per_rank, "ranks": args.ranks,
                     "max_abs_difference": max((g - w).abs().max().item()
                                               for g, w in zip(grads, whole, strict=True)),
                     "max_abs_gradient": max(w.abs().max().item() for w in whole),
                     # how many times smaller than the whole batch's gradient
                     "norm_ratio": (torch.cat([w.flatten() for w in whole]).norm()
                                    / torch.cat([g.flatten() for g in grads]).norm()).item()})
    return rows


def train(args, cfg, batches, accumulate: bool, device) -> dict:
    """--train-steps AdamW steps on the same batches, whole or as --accum-steps micro-batches."""
    torch.manual_seed(args.seed)
    model = GPT(cfg).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=DEFAULTS.lr)
    sizes = [args.micro_batch_size] * args.accum_steps if accumulate else [len(batches[0][0])]
    losses = []

    def step(x, y):
        loss = 0.0
        for xs, ys, weight in zip(x.split(sizes), y.split(sizes), mean_loss_weights(sizes), strict=True):
            micro_loss = model(xs, ys) * weight
            micro_loss.backward()
            loss += micro_loss.item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss)

    data = iter(batches)
    step_ms = median_ms(lambda: step(*next(data)), repeats=len(batches) - 1, device=device)
    x, y = batches[0]
    with SavedTensors(exclude=model.parameters()) as saved:
        model(x[: sizes[0]], y[: sizes[0]])  # what one backward pass needs kept: one (micro-)batch
    return {"losses": losses, "step_ms": step_ms, "activation_bytes": saved.bytes}


def main() -> None:
    args = parse_args()
    backend, device = start_single_device(args.backend)
    metrics = open_metrics(args.metrics, backend, device)
    cfg = MODEL_SIZES[args.model]
    batch = args.micro_batch_size * args.accum_steps
    dataset = corpus_windows(DEFAULTS.corpus_tokens, cfg.vocab_size, cfg.context, args.seed)
    batches = first_batches(dataset, batch, 0, 1, args.seed, args.train_steps, device)
    torch.manual_seed(args.seed)
    model = GPT(cfg).to(device)
    print(f"{args.model} model; a batch of {batch} windows = {args.accum_steps} micro-batches of "
          f"{args.micro_batch_size}, on {device}")

    print(f"{'split':<40} {'sizes':<14} {'max |diff| / max |grad|':>24}")
    for row in compare_splits(args, model, *batches[0]):
        metrics.write(event="split", **row)
        print(f"{row['case']:<40} {'+'.join(map(str, row['sizes'])):<14} "
              f"{row['max_abs_difference'] / row['max_abs_gradient']:>24.2e}")

    for row in compare_data_parallel(args, model, *batches[0]):
        metrics.write(event="ranks", **row)
        print(f"{args.ranks} ranks, {row['case']:<30} max |diff| / max |grad| "
              f"{row['max_abs_difference'] / row['max_abs_gradient']:.2e}, "
              f"{row['norm_ratio']:.3f} times too small")

    for accumulate in (False, True):
        run = train(args, cfg, batches, accumulate, device)
        label = f"{args.accum_steps} x {args.micro_batch_size} accumulated" if accumulate else f"1 x {batch}"
        metrics.write(event="training", accumulate=accumulate, label=label, **run)
        print(f"{label:<20} loss {run['losses'][0]:.4f} -> {run['losses'][-1]:.4f}, "
              f"saved for backward {run['activation_bytes'] / 2**20:.2f} MiB, median step {run['step_ms']:.1f} ms")
    metrics.close()
    drain_gloo_workers()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)

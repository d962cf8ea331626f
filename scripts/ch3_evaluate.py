"""Distributed evaluation: the exact metric, and two that look right but are not.

    torchrun --standalone --nproc_per_node=2 scripts/ch3_evaluate.py
    python scripts/ch3_evaluate.py --val-windows 11     # one process: the reference

Every rank trains the same small GPT for a few steps on one process (same seed, same
data, no communication), so that there is a model worth evaluating. The evaluation is
the distributed part: a validation set of --val-windows windows (held out from the
end of the corpus, deliberately not a multiple of the world size) is split across the
ranks, and the ranks' results are combined three ways:

  padded, mean of means    DistributedSampler, which pads the index list by
                           repeating its first items; each rank averages its shard,
                           the ranks average the averages: repeated items count twice
  unpadded, mean of means  rank r takes items r, r + W, r + 2W, ...: nothing repeats,
                           but the shards differ in length, and a mean of means gives
                           the items of the shorter shard more weight
  unpadded, sum and count  the same shards; the loss sum, the correct guesses and
                           the counts are all-reduced, then divided: each item once

Rank 0 also evaluates the whole set alone: the number the others must match.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

from dtbook.cli import add_backend_and_metrics, positive_int, run_main, script_parser
from dtbook.data import DEFAULTS, TokenWindows, rank_loader, synthetic_corpus
from dtbook.distributed import drain_gloo_workers, open_metrics, start_process_group
from dtbook.model import GPT, MODEL_SIZES


def parse_args() -> argparse.Namespace:
    parser = script_parser(__doc__)
    add = parser.add_argument
    add("--val-windows", type=positive_int, default=11,
        help="windows in the validation set (default 11: not a multiple of 2 or 4)")
    add("--train-steps", type=positive_int, default=20,
        help="training steps before evaluating (default 20)")
    add("--batch-size", type=positive_int, default=4,
        help="evaluation batch per process")
    add("--seed", type=int, default=0)
    add_backend_and_metrics(parser)
    return parser.parse_args()


def briefly_trained_model(args, train, device) -> GPT:
    """The same model on every rank: a few AdamW steps, seeded alike."""
    torch.manual_seed(args.seed)
    model = GPT(MODEL_SIZES["tiny"]).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=DEFAULTS.lr)
    loader = rank_loader(train, 16, rank=0, world_size=1, seed=args.seed)
    for _, (x, y) in zip(range(args.train_steps), loader, strict=False):
        model(x.to(device), y.to(device)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval()


@torch.no_grad()
def sums_over(model, loader, device) -> torch.Tensor:
    """[sum of per-window losses, correct next-token guesses, tokens, windows]."""
    totals = torch.zeros(4, dtype=torch.float64, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        logits = model(x)
        per_token = F.cross_entropy(logits.transpose(1, 2), y, reduction="none")
        hits = (logits.argmax(dim=-1) == y).sum()
        counts = torch.tensor([y.numel(), len(x)], device=device)
        totals += torch.cat([per_token.mean(dim=1).sum().reshape(1),
                             hits.reshape(1), counts]).double()
    return totals


def metrics_from(totals: torch.Tensor) -> dict:
    loss_sum, hits, tokens, windows = totals.tolist()
    return {"loss": loss_sum / windows, "accuracy": hits / tokens,
            "hits": int(hits), "tokens": int(tokens), "windows": int(windows)}


def mean_of_means(shard: dict, device) -> dict:
    """The naive combination: each rank's mean counts the same, whatever its size."""
    means = torch.tensor([shard["loss"], shard["accuracy"]], device=device)
    dist.all_reduce(means)
    loss, accuracy = (means / dist.get_world_size()).tolist()
    return {"loss": loss, "accuracy": accuracy}


def evaluate(model, val, args, device) -> dict[str, dict]:
    """The three distributed evaluations; every rank returns the same numbers."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    results = {}

    # DistributedSampler gives every rank an equal share by repeating items.
    padded = DistributedSampler(val, shuffle=False)
    loader = DataLoader(val, args.batch_size, sampler=padded)
    shard = metrics_from(sums_over(model, loader, device))
    results["padded, mean of means"] = {**mean_of_means(shard, device),
                                        "windows": len(padded) * world_size}

    # Each item once: rank r takes r, r + W, ... (the shards may differ in length).
    unpadded = Subset(val, range(rank, len(val), world_size))
    totals = sums_over(model, DataLoader(unpadded, args.batch_size), device)
    naive = mean_of_means(metrics_from(totals), device)
    results["unpadded, mean of means"] = {**naive, "windows": len(val)}
    dist.all_reduce(totals)  # one collective on every rank, however long its shard
    results["unpadded, sum and count"] = metrics_from(totals)
    return results


def main() -> None:
    args = parse_args()
    backend, device = start_process_group(args.backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    metrics = open_metrics(args.metrics, backend, device)
    cfg = MODEL_SIZES["tiny"]
    # One corpus: the training windows first, the held-out validation windows last.
    train_tokens, val_tokens = 20_000, args.val_windows * cfg.context
    tokens = synthetic_corpus(train_tokens + val_tokens + 1, cfg.vocab_size,
                              args.seed)
    train = TokenWindows(tokens[: train_tokens + 1], cfg.context)
    val = TokenWindows(tokens[train_tokens:], cfg.context)
    model = briefly_trained_model(args, train, device)

    results = evaluate(model, val, args, device)
    if rank == 0:  # the reference: one process, the whole set, each window once
        whole = DataLoader(val, args.batch_size)
        alone = sums_over(model, whole, device)
        results["one process, whole set"] = metrics_from(alone)
        print(f"{len(val)} validation windows on {world_size} process(es)")
        print(f"{'evaluation':<26}{'windows':>8}{'mean loss':>12}{'accuracy':>10}")
        for name, result in results.items():
            metrics.write(event="evaluation", method=name, **result)
            print(f"{name:<26}{result['windows']:>8}{result['loss']:>12.6f}"
                  f"{result['accuracy']:>10.4%}")
    metrics.close()
    drain_gloo_workers()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)

"""The book's data: a deterministic synthetic corpus, cut into windows, split across ranks.

No downloads: the corpus is generated from a seed, so every rank and every machine sees the same
tokens. ``rank_loader`` is the one place where a rank's share of each epoch is decided.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import islice

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler


@dataclass(frozen=True)
class TrainingDefaults:
    """ch3_train.py's defaults, which every experiment on "the chapter's model" reuses."""

    corpus_tokens: int = 160_000
    batch_size: int = 16
    lr: float = 1e-2
    bucket_cap_mb: float = 25.0
    seed: int = 0


DEFAULTS = TrainingDefaults()


def synthetic_corpus(num_tokens: int, vocab_size: int, seed: int) -> torch.Tensor:
    """A deterministic token stream with structure a small model can learn.

    Tokens come from a random sparse Markov chain: each token has a handful of likely successors.
    The entropy is well below log(vocab_size), so the loss has somewhere to fall, and the same seed
    always gives the same corpus on every rank and every machine (drawn on the CPU with our own
    generator).
    """
    gen = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, vocab_size, (vocab_size, 4), generator=gen)
    weights = torch.tensor([0.55, 0.25, 0.15, 0.05])
    choices = torch.multinomial(weights, num_tokens, replacement=True, generator=gen)
    table, picks = successors.tolist(), choices.tolist()
    tokens = [0] * num_tokens
    for i in range(1, num_tokens):
        tokens[i] = table[tokens[i - 1]][picks[i]]
    return torch.tensor(tokens, dtype=torch.long)


class TokenWindows(Dataset):
    """Non-overlapping (input, target) windows of ``context`` tokens."""

    def __init__(self, tokens: torch.Tensor, context: int):
        self.tokens = tokens
        self.context = context

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.context

    def __getitem__(self, i: int):
        # Past the end the slice would be empty, not an error: iterating the dataset
        # (zip, list) relies on IndexError to stop, and would never end without it.
        if not 0 <= i < len(self):
            raise IndexError(f"window {i} of a dataset of {len(self)}")
        start = i * self.context
        chunk = self.tokens[start : start + self.context + 1]
        return chunk[:-1], chunk[1:]


def corpus_windows(corpus_tokens: int, vocab_size: int, context: int, seed: int) -> TokenWindows:
    """The training set of the book's programs: windows of the synthetic corpus."""
    return TokenWindows(synthetic_corpus(corpus_tokens, vocab_size, seed), context)


def rank_loader(dataset: Dataset, batch_size: int, rank: int, world_size: int, seed: int) -> DataLoader:
    """This rank's loader: a disjoint slice of one shuffle that all ranks agree on.

    The sampler shuffles with seed + epoch (call ``loader.sampler.set_epoch`` every epoch), and
    ``drop_last`` gives every rank the same number of windows, none padded with repeats. The
    loader gets its own generator, so starting an epoch draws nothing from the global RNG that
    checkpoints capture and dropout uses.
    """
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed,
                                 drop_last=True)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True,
                      generator=torch.Generator())


def first_batches(dataset: Dataset, batch_size: int, rank: int, world_size: int, seed: int, count: int,
                  device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first ``count`` batches this rank trains on in epoch 0, already on ``device``."""
    loader = rank_loader(dataset, batch_size, rank, world_size, seed)
    return [(x.to(device), y.to(device)) for x, y in islice(loader, count)]

"""Section 8.2's tensor-parallel plan for the book's GPT, which section 8.7 reuses on a mesh.

``shard`` cuts a weight the way Megatron's column- and row-parallel layers do (8.1);
``dtensor_parallel`` applies the four-line plan of ``ColwiseParallel`` and ``RowwiseParallel``
to every block (8.2), after ``heads_grouped_by_rank`` has put rank r's q, k and v rows of the
fused ``qkv`` layer next to each other. ``heads_in_model_order`` undoes that regrouping, so a
tensor-parallel run's weights can be compared with, or saved as, one process's.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from dtbook.model import GPT


def shard(full: torch.Tensor, dim: int, parts: int, rank: int,
          world: int) -> torch.Tensor:
    """Rank ``rank``'s 1/world of each of the ``parts`` parts of ``full``."""
    pieces = full.chunk(parts, dim)
    return torch.cat([p.chunk(world, dim)[rank] for p in pieces], dim)


def unshard(shards: list[torch.Tensor], dim: int, parts: int) -> torch.Tensor:
    """The inverse of ``shard``: every rank's piece of every part, back in place."""
    pieces = [s.chunk(parts, dim) for s in shards]
    return torch.cat([torch.cat([p[i] for p in pieces], dim) for i in range(parts)], dim)


def heads_grouped_by_rank(model: GPT, world: int) -> None:
    """Reorder each fused qkv's rows to [q_0 k_0 v_0 | q_1 k_1 v_1 | ...].

    ColwiseParallel gives rank r the r-th contiguous chunk of rows; in the original
    order [q | k | v] that would be all of q and half of k. After this reordering
    rank r's chunk is exactly TensorParallelBlock's shard, and the Block's own
    forward (qkv.chunk(3)) stays right.
    """
    with torch.no_grad():
        for block in model.blocks:
            for tensor in (block.qkv.weight, block.qkv.bias):
                pieces = [shard(tensor, 0, 3, r, world) for r in range(world)]
                tensor.copy_(torch.cat(pieces))


def heads_in_model_order(qkv: torch.Tensor, world: int) -> torch.Tensor:
    """A whole qkv weight or bias regrouped by ``heads_grouped_by_rank``, back to [q | k | v]."""
    return unshard(list(qkv.chunk(world)), 0, 3)


def dtensor_parallel(model: GPT, mesh, group_heads: bool = True) -> GPT:
    """The same split with PyTorch's API: a plan per block, parallelize_module."""
    if group_heads:  # False only in the control run
        heads_grouped_by_rank(model, mesh.size())
    plan = {"qkv": ColwiseParallel(), "proj": RowwiseParallel(),
            "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()}
    for block in model.blocks:
        parallelize_module(block, mesh, plan)
    return model

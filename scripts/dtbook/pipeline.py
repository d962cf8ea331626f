"""Section 8.3's cut of the book's GPT into pipeline stages, which section 8.7 reuses on a mesh.

A ``Stage`` holds consecutive blocks under the GPT's own parameter names; the first stage also
embeds the tokens, the last one ends in the final LayerNorm and the (tied) head, whose logits
``loss_fn`` scores.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from dtbook.model import GPT, at_least_float32


class Stage(nn.Module):
    """Blocks ``first`` to ``last - 1`` of a GPT; the first stage embeds, the last
    one ends in the head; parameters keep the GPT's names (blocks.2.qkv.weight)."""

    def __init__(self, gpt: GPT, first: int, last: int):
        super().__init__()
        self.is_first, self.is_last = first == 0, last == len(gpt.blocks)
        if self.is_first:
            self.tok_emb, self.pos_emb = gpt.tok_emb, gpt.pos_emb
        self.blocks = nn.ModuleDict({str(i): gpt.blocks[i]
                                     for i in range(first, last)})
        if self.is_last:
            self.ln_f, self.head = gpt.ln_f, gpt.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:  # x: tokens
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.tok_emb(x) + self.pos_emb(pos)
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.ln_f(x)) if self.is_last else x


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(at_least_float32(logits.flatten(0, 1)), targets.flatten())

"""The book's model: a small GPT (token and position embeddings, pre-norm blocks, a tied head).

Small enough to train in seconds on a laptop CPU, real enough that its gradients, buckets and
memory behave like a large language model's. ``MODEL_SIZES`` names the sizes the chapters use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 256
    context: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0


MODEL_SIZES = {
    "tiny": GPTConfig(n_layer=2, n_head=2, n_embd=32),
    "small": GPTConfig(n_layer=2, n_head=4, n_embd=64),
    "medium": GPTConfig(n_layer=4, n_head=4, n_embd=128),
    "large": GPTConfig(n_layer=6, n_head=8, n_embd=256),
    # GPT-2 small's shape (124.5 M parameters; the vocabulary padded to a multiple of 64), the
    # size at which a GPU measures precision, compile and SDPA rather than kernel launches.
    "gpt2-small": GPTConfig(vocab_size=50304, context=1024, n_layer=12, n_head=12, n_embd=768),
}
# Sizes the book never runs on a CPU: one step of gpt2-small takes minutes there.
GPU_ONLY_SIZES = {"gpt2-small"}


class Block(nn.Module):
    """One pre-norm transformer block: attention then MLP, each with a residual."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        )
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Sizes come from the tensors, not the config: under tensor parallelism (chapter 8) qkv
        # holds only this rank's heads, and the same forward then runs on those heads alone.
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=2)
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.dropout(self.proj(y.transpose(1, 2).reshape(b, t, -1)))
        return x + self.dropout(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """A small GPT: token + position embeddings, a stack of blocks, a tied head."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.context, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight
        self.init_weights()

    def init_weights(self) -> None:
        """GPT-2's initialization, drawn from the global RNG in module order.

        PyTorch's default N(0, 1) embedding, tied to the output head, would make the first logits
        huge and the first loss several times log(vocab_size). A model built on the meta device
        and materialized with ``to_empty`` calls this again to get real values.
        """
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, nn.LayerNorm):
                module.reset_parameters()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(at_least_float32(logits.flatten(0, 1)), targets.flatten())


def at_least_float32(logits: torch.Tensor) -> torch.Tensor:
    """bf16 or fp16 logits as float32 for the loss (their softmax would lose bits), float32
    and float64 as they are: a float64 model computes its loss in float64."""
    # Decided in Python: torch.promote_types is itself an ATen op, and 1.2 lists the ops that ran.
    return logits if logits.dtype in (torch.float32, torch.float64) else logits.float()


def without_key_bias(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights minus the key part of every attention block's qkv bias, for comparing two runs.

    Adding a constant vector to every key adds the same number to all of a query's attention
    scores, and softmax ignores that, so the true gradient of the key bias is exactly zero. What
    backward computes there is rounding noise, and Adam divides by its own running RMS, turning
    noise of any size into steps of about lr: these entries carry no information about a run and
    legitimately differ between two runs that sum their gradients in a different order.
    """
    out = {}
    for name, tensor in weights.items():
        if name.endswith("qkv.bias"):
            n_embd = tensor.numel() // 3
            tensor = torch.cat([tensor[:n_embd], tensor[2 * n_embd:]])
        out[name] = tensor
    return out

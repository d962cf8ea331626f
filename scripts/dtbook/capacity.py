"""What fits on one GPU, and when data parallelism waits for the network.

Chapter 7's what-if formulas: model predictions, not measurements. The chapter checks the
ones it can against what the book measured (the state bytes against chapter 4's per-rank
counts, the FLOPs against PyTorch's FLOP counter) and states the rest as assumptions.

Memory per rank, for a model of ``params`` parameters on N ranks (ZeRO, Rajbhandari et al.
2020): weights, gradients and optimizer state, each divided by the ranks that share it,

    strategy   weights   gradients   optimizer state
    ddp        w         g           k
    zero1      w         g           k / N
    zero2      w         g / N       k / N
    zero3      w / N     g / N       k / N          (FSDP's full sharding)

times ``params``, with (w, g, k) bytes per parameter from a ``Recipe``. Two recipes train
the same mixed-precision model and both come to 16 bytes per parameter; they split them
differently, which matters for every stage that shards some of the three and not others:

    FP32_ADAMW         (4, 4, 8)   PyTorch's AMP, the book's recipe (chapter 3): autocast
                                   keeps fp32 weights, DDP all-reduces fp32 gradients, FSDP2
                                   with reduce_dtype=fp32 keeps fp32 shards of both
    FP16_MIXED_ADAMW   (2, 2, 12)  the ZeRO paper's: fp16 weights and gradients, an fp32
                                   master copy in the optimizer state

The gradients' bytes are also what data parallelism sends, so the recipe moves the
communication-bound point too. (ZeRO-3 gathers ``w`` bytes per weight: FSDP2 with
param_dtype=bf16 gathers 2 even under the book's recipe, so its ZeRO-3 figure is an upper bound.)

Time of a data-parallel step: 6 FLOPs per weight per token (a multiply-add is 2 FLOPs, the
backward pass costs twice the forward) plus 12 * layers * context * width per token for the
attention scores, plus the blocks' forward once more under full activation checkpointing
(``recompute_flops``), at ``hfu`` times the GPU's peak (the fraction of peak the FLOPs executed
reach: the hardware FLOPs utilisation, equal to the model FLOPs utilisation when nothing is
recomputed); and the gradients' ring all-reduce of
dtbook.cost_model, 2 (N-1)/N * bytes / bus bandwidth, or for ZeRO-3 two all-gathers of the
weights and one reduce-scatter of the gradients.

No torch here: the notebook side imports it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dtbook.cost_model import AlphaBeta

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
GB = 1e9  # datasheets' decimal gigabyte


@dataclass(frozen=True)
class Recipe:
    """Bytes per parameter of the weights, the gradients and the optimizer's state."""

    name: str
    weights: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer


FP32_ADAMW = Recipe("PyTorch AMP (fp32 weights, grads)", 4, 4, 8)
FP16_MIXED_ADAMW = Recipe("ZeRO paper (fp16 weights, grads)", 2, 2, 12)
RECIPES = (FP32_ADAMW, FP16_MIXED_ADAMW)


def state_bytes_per_rank(strategy: str, params: float, world_size: int,
                         recipe: Recipe = FP16_MIXED_ADAMW) -> dict[str, float]:
    """Bytes of weights, gradients and optimizer state one rank keeps."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}: "
                         f"choose one of {', '.join(STRATEGIES)}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    stage = STRATEGIES.index(strategy)  # ZeRO-k shards the last k of the three
    n = world_size
    return {"weights": params * recipe.weights / (n if stage >= 3 else 1),
            "grads": params * recipe.grads / (n if stage >= 2 else 1),
            "optimizer": params * recipe.optimizer / (n if stage >= 1 else 1)}


@dataclass(frozen=True)
class Transformer:
    """A GPT-style decoder: blocks of one width, an embedding tied to the output head."""

    layers: int
    width: int
    vocab: int = 50257  # GPT-2's and GPT-3's tokenizer

    @property
    def layer_params(self) -> int:
        """One block's attention (4 h^2) and MLP (8 h^2) weights; biases, norms left out."""
        return 12 * self.width**2

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.vocab * self.width

    @classmethod
    def with_aspect(cls, layers: int, width_per_layer: int = 128) -> Transformer:
        """GPT-3's 6.7B and 175B models have width = 128 * layers (Brown et al. 2020)."""
        return cls(layers, width_per_layer * layers)


def activation_bytes(model: Transformer, context: int, micro_batch: int,
                     checkpointing: bool, dropout: bool = True) -> float:
    """Activations kept for backward, 16-bit, after Korthikanti et al. 2022.

    Their count for one block, with dropout, is s*b*h*(34 + 5*a*s/h) bytes. A fused
    attention kernel (FlashAttention; scaled_dot_product_attention on a GPU) keeps no
    s x s scores, which leaves 34*s*b*h; without dropout the two 1-byte masks after
    the attention projection and the MLP go too, 32*s*b*h. Full activation
    checkpointing keeps each block's input (2*s*b*h) and recomputes one block at a
    time in backward, whose activations come on top. The embedding and the logits
    are left out.
    """
    per_block = (34 if dropout else 32) * context * micro_batch * model.width
    if checkpointing:
        return model.layers * 2 * context * micro_batch * model.width + per_block
    return model.layers * per_block


def bytes_per_rank(strategy: str, model: Transformer, world_size: int, context: int,
                   micro_batch: int, checkpointing: bool = False,
                   recipe: Recipe = FP16_MIXED_ADAMW,
                   dropout: bool = True) -> dict[str, float]:
    """State and activations; for ZeRO-3 also the gathered weights of two blocks
    (the one computing and the one prefetched)."""
    row = state_bytes_per_rank(strategy, model.params, world_size, recipe)
    row["activations"] = activation_bytes(model, context, micro_batch, checkpointing,
                                         dropout)
    sharded = strategy == "zero3" and world_size > 1
    row["gathered"] = 2 * model.layer_params * recipe.weights if sharded else 0
    return row


def largest_fitting(strategy: str, world_size: int, memory_bytes: float, context: int,
                    micro_batch: int, checkpointing: bool = False,
                    recipe: Recipe = FP16_MIXED_ADAMW,
                    dropout: bool = True) -> Transformer | None:
    """The deepest GPT-3-shaped model (width 128 per layer) that fits; None if none does."""
    def fits(layers: int) -> bool:
        model = Transformer.with_aspect(layers)
        need = bytes_per_rank(strategy, model, world_size, context, micro_batch,
                              checkpointing, recipe, dropout)
        return sum(need.values()) <= memory_bytes

    if not fits(1):
        return None
    low, high = 1, 2
    while fits(high):
        low, high = high, 2 * high
    while high - low > 1:  # fits(low) and not fits(high)
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return Transformer.with_aspect(low)


def training_flops(matmul_params: float, tokens: float, layers: int = 0,
                   context: int = 0, width: int = 0) -> float:
    """Forward plus backward: 6 per weight per token, 12*L*s*h per token of attention.

    ``matmul_params`` counts the weights that multiply every token: the linear layers
    and the output head, not the embedding lookups. Without ``layers``, no attention.
    """
    return 6 * matmul_params * tokens + 12 * layers * context * width * tokens


def recompute_flops(recomputed_matmul_params: float, tokens: float, layers: int = 0,
                    context: int = 0, width: int = 0) -> float:
    """What full activation checkpointing adds: the blocks' forward, run again in backward.

    A forward pass is a third of ``training_flops``: 2 of the 6 per weight per token, 4 of
    the 12*L*s*h of attention. ``recomputed_matmul_params`` counts the weights whose
    matmuls run again: see ``recomputed_params``.
    """
    return 2 * recomputed_matmul_params * tokens + 4 * layers * context * width * tokens


def recomputed_params(model: Transformer, dropout: bool = True) -> int:
    """The block weights that full activation checkpointing multiplies again in backward.

    torch's non-reentrant checkpoint stops recomputing as soon as every tensor backward
    saved is back (its early stop, on by default). When a block ends in matmul + residual,
    the last matmul's output is saved by nothing, so it is not rerun: 8 of the 12 h^2.
    With dropout after it, the dropout saves its mask, computed from that output, so the
    whole forward runs again: all 12 h^2.
    """
    return model.layers * (12 if dropout else 8) * model.width**2


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_bytes: float
    peak_flops: float  # dense, in the precision the model trains in
    source: str


H100_SXM = Gpu("H100 SXM", 80 * GB, 989e12,
               "NVIDIA H100 datasheet: 80 GB HBM3, 989 TFLOPS dense BF16 (1979 sparse)")


@dataclass(frozen=True)
class Link:
    """The bus bandwidth a ring all-reduce sees: its slowest hop, times parallel rings."""

    name: str
    bus_bytes_per_s: float
    source: str


LINKS = (
    Link("NVLink 4, within one node", 450 * GB,
         "NVIDIA H100 datasheet: NVLink 900 GB/s per GPU, both directions"),
    Link("8 x InfiniBand NDR per node", 8 * 50 * GB,
         "DGX H100: eight 400 Gb/s ConnectX-7 ports, one per GPU"),
    Link("1 x InfiniBand NDR per node", 50 * GB, "InfiniBand NDR: 400 Gb/s per port"),
    Link("1 x 100 GbE per node", 12.5 * GB, "IEEE 802.3 100 Gb/s Ethernet"),
    Link("1 x 25 GbE per node", 3.125 * GB, "IEEE 802.3 25 Gb/s Ethernet"),
)


def data_parallel_step(model: Transformer, tokens_per_gpu: float, world_size: int,
                       link: Link, gpu: Gpu, hfu: float, context: int,
                       strategy: str = "ddp", recipe: Recipe = FP16_MIXED_ADAMW,
                       alpha_s: float = 0.0, checkpointing: bool = False,
                       dropout: bool = True) -> dict[str, float]:
    """Seconds of compute and of gradient communication in one step, each alone.

    With perfect overlap a step lasts the longer of the two; with none, their sum.
    Full activation checkpointing adds the blocks' second forward to the compute
    (all of it with dropout, as ``activation_bytes`` assumes by default; see
    ``recomputed_params``); the bytes sent do not change.

    ``hfu`` is the fraction of peak at which the FLOPs *executed* run, recomputation
    included: a hardware FLOPs utilisation (HFU). Without checkpointing it equals the
    model FLOPs utilisation (MFU); with it, the returned ``mfu`` (model FLOPs over
    step time and peak) is lower: a step that recomputes reaches a lower MFU at the
    same HFU.
    """
    # Every weight multiplies every token: the blocks' and the tied head's.
    model_flops = training_flops(model.params, tokens_per_gpu, model.layers, context,
                                 model.width)
    flops = model_flops
    if checkpointing:
        flops += recompute_flops(recomputed_params(model, dropout), tokens_per_gpu,
                                 model.layers, context, model.width)
    compute = flops / (gpu.peak_flops * hfu)
    ring = AlphaBeta(alpha_s, 1 / link.bus_bytes_per_s)
    grads = recipe.grads * model.params
    if strategy == "zero3":  # weights gathered for forward and backward
        weights = recipe.weights * model.params
        comm = (2 * ring.predict(weights, world_size, "all_gather")
                + ring.predict(grads, world_size, "reduce_scatter"))
    else:
        comm = ring.predict(grads, world_size, "all_reduce")
    return {"compute_s": compute, "comm_s": comm,
            "comm_over_compute": comm / compute,
            "mfu": hfu * model_flops / flops}


def communication_bound_world(model: Transformer, global_batch_tokens: float,
                              link: Link, gpu: Gpu, mfu: float, context: int,
                              strategy: str = "ddp",
                              recipe: Recipe = FP16_MIXED_ADAMW) -> int:
    """The fewest GPUs at which, for a fixed global batch, communication takes as long
    as compute.

    Bandwidth term only (alpha = 0): with B/N tokens per GPU, compute falls as 1/N and
    the ring's time grows as (N-1)/N, so their ratio is exactly (N-1) times its value
    at N = 2.
    """
    at_two = data_parallel_step(model, global_batch_tokens / 2, 2, link, gpu, mfu,
                                context, strategy, recipe)["comm_over_compute"]
    return 1 + math.ceil(1 / at_two)

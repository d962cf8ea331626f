"""Chapter 1, section 3: checkpointing changes memory and compute, never the gradients."""

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from dtbook.measure import LiveStoragePeak
from dtbook.model import GPT, MODEL_SIZES

# Recomputation repeats the same ops on the same inputs, so on a CPU the gradients come out bit for
# bit equal (measured). The tolerance allows a few float32 epsilons of the largest gradient entry,
# because bitwise equality is not promised: on a GPU a recomputation may pick another kernel.
TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def setup():
    cfg = dataclasses.replace(MODEL_SIZES["tiny"], dropout=0.1)  # dropout: the RNG must be replayed
    torch.manual_seed(0)
    model = GPT(cfg)
    gen = torch.Generator().manual_seed(1)
    x, y = (torch.randint(cfg.vocab_size, (4, cfg.context), generator=gen) for _ in "xy")
    return model, x, y


def gradients(model, x, y):
    torch.manual_seed(123)  # the same dropout masks for every variant
    model(x, y).backward()
    return [p.grad.clone() for p in model.parameters()]


def relative_difference(grads, reference):
    largest = max(r.abs().max().item() for r in reference)
    return max((g - r).abs().max().item() for g, r in zip(grads, reference, strict=True)) / largest


@pytest.mark.parametrize("strategy", ["every block", "every other", "sequential", "selective"])
def test_checkpointed_gradients_equal_the_plain_models(checkpointing, setup, strategy):
    model, x, y = setup
    reference = gradients(checkpointing.with_strategy(model, "none", 2), x, y)
    variant = checkpointing.with_strategy(model, strategy, 2)
    assert [p.shape for p in variant.parameters()] == [p.shape for p in model.parameters()]
    assert relative_difference(gradients(variant, x, y), reference) <= TOLERANCE


def test_recomputing_without_the_rng_state_gives_wrong_gradients(checkpointing, setup):
    """The control: new dropout masks in the recomputation must fail the same tolerance."""
    model, x, y = setup
    reference = gradients(checkpointing.with_strategy(model, "none", 2), x, y)
    control = checkpointing.with_strategy(model, "every block", 2, preserve_rng_state=False)
    assert relative_difference(gradients(control, x, y), reference) > 1000 * TOLERANCE


def test_every_block_has_the_lowest_peak_by_two_independent_measurements(checkpointing, setup):
    """Memory is measured apart from FlopCounterMode, whose module hooks keep recomputed
    activations alive: the control measures under both and must lose the saving."""
    model, x, y = setup
    cpu = torch.device("cpu")
    peaks = {}
    for strategy in ("none", "every block"):
        variant = checkpointing.with_strategy(model, strategy, 2)
        live = LiveStoragePeak()
        checkpointing.one_step(variant, x, y, 0, live)
        peaks[strategy] = (checkpointing.memory_pass(variant, x, y, 0, cpu)["peak_bytes"],
                           live.peak_bytes)
    assert all(a < b for a, b in zip(peaks["every block"], peaks["none"], strict=True))
    variant = checkpointing.with_strategy(model, "every block", 2)
    under_counter = checkpointing.memory_pass(variant, x, y, 0, cpu, FlopCounterMode(display=False))
    assert under_counter["peak_bytes"] > peaks["every block"][0]


def test_live_storage_peak_counts_the_parameters_that_ops_return_views_of(checkpointing, setup):
    """LiveStoragePeak counts a parameter's storage once an op returns a view of it: the Linear
    weights (``aten.t``) and the tied head. In the plain model embeddings, biases and layer-norm
    weights are only op inputs, so they stay out of its count, while MemTracker counts every
    parameter. Under checkpoint the recomputation saves ``aten.detach`` views of the layer-norm
    weights and biases, so those of the checkpointed blocks can count too."""
    model, x, y = setup
    live = LiveStoragePeak()
    checkpointing.one_step(model, x, y, 0, live)
    viewed = {m.weight.untyped_storage().data_ptr(): m.weight.nbytes
              for m in model.modules() if isinstance(m, torch.nn.Linear)}
    assert live.bytes_at_peak(model.parameters()) == sum(viewed.values())
    assert 0 < sum(viewed.values()) < sum(p.nbytes for p in model.parameters())
    weights = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    linear = {n for n, p in model.named_parameters() if id(p) in weights}  # the tied head once
    assert set(live.tensors_at_peak(dict(model.named_parameters()))) == linear
    variant = checkpointing.with_strategy(model, "every block", 2)
    live = LiveStoragePeak()
    checkpointing.one_step(variant, x, y, 0, live)
    names = set(live.tensors_at_peak(dict(variant.named_parameters())))
    extra = {n.replace(".block.", ".") for n in names} - linear  # Checkpointed adds ".block"
    assert all(".ln" in n for n in extra), extra  # none for this tiny model; some for medium


def test_the_guard_skips_checkpoint_only_without_grad(checkpointing, setup):
    model, x, _ = setup
    plain_calls, plain = checkpointing.rng_stashes(checkpointing.with_strategy(model, "none", 2), x,
                                                   False, False)
    guarded = checkpointing.with_strategy(model, "every block", 2)
    for training in (False, True):
        calls, logits = checkpointing.rng_stashes(guarded, x, training, grad=False)
        assert plain_calls == calls == 0
    calls, logits = checkpointing.rng_stashes(guarded, x, training=False, grad=False)
    assert torch.equal(logits, plain)
    calls, _ = checkpointing.rng_stashes(guarded, x, training=False, grad=True)  # eval mode, grad on
    assert calls == len(model.blocks)
    assert guarded.training  # rng_stashes leaves the model in training mode


def test_flops_count_attention_only_under_the_math_backend(checkpointing, setup):
    """The CPU's default attention kernel is not in FlopCounterMode's registry; MATH adds
    12 B T^2 C per block for forward plus backward (two bmm forward, four backward)."""
    model, x, y = setup
    row = checkpointing.measured_step(model, x, y, 0, torch.device("cpu"))
    cfg = dataclasses.replace(MODEL_SIZES["tiny"])
    b, t = x.shape
    assert row["flops"] - row["flops_default_backend"] == 12 * b * t * t * cfg.n_embd * cfg.n_layer

"""dtbook.compare, the book's one definition of the same training: each rule fails when it should."""

import pytest
import torch

from dtbook.compare import (
    GAP_PER_STEP,
    compare_gaps,
    compare_training,
    same_training,
    same_training_tolerance,
    training_gap,
)
from dtbook.model import GPT, MODEL_SIZES


def weights(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: v.detach().clone() for k, v in GPT(MODEL_SIZES["tiny"]).state_dict().items()}


def nudged(state: dict[str, torch.Tensor], relative: float) -> dict[str, torch.Tensor]:
    """Every tensor moved by ``relative`` of its own size, in a direction of its own."""
    generator = torch.Generator().manual_seed(7)
    return {k: v + relative * v.abs().mean() * torch.randn(v.shape, generator=generator) for k, v in state.items()}


def test_the_gap_is_relative_so_it_means_the_same_at_any_scale():
    a = weights(0)
    b = nudged(a, 1e-3)
    scaled = {k: 1000 * v for k, v in a.items()}, {k: 1000 * v for k, v in b.items()}
    assert training_gap(b, a) == pytest.approx(training_gap(*scaled[::-1]), rel=1e-5)  # float32 products
    assert training_gap(a, a) == 0


def test_the_key_bias_is_left_out():
    """Rounding noise that Adam amplifies there must not count (see without_key_bias)."""
    a = weights(0)
    b = dict(a)
    name = next(k for k in a if k.endswith("qkv.bias"))
    n_embd = a[name].numel() // 3
    b[name] = a[name].clone()
    b[name][n_embd:2 * n_embd] += 1.0  # the key part alone
    assert training_gap(b, a) == 0
    b[name][:n_embd] += 1.0  # the query part counts
    assert training_gap(b, a) > 0


def test_the_tolerance_grows_with_the_steps_and_refuses_none():
    assert same_training_tolerance(30) == pytest.approx(30 * GAP_PER_STEP)
    assert same_training_tolerance(60) == 2 * same_training_tolerance(30)
    with pytest.raises(ValueError):
        same_training_tolerance(0)


def test_rounding_passes_and_other_weights_fail():
    a = weights(0)
    assert same_training(nudged(a, 1e-6), a, steps=1)
    assert not same_training(weights(1), a, steps=1000)  # another initialisation: not close at all


def test_a_comparison_needs_a_control_and_margins_on_both_sides(capsys):
    a = weights(0)
    run, control = nudged(a, 1e-5), nudged(a, 1.0)
    rows = compare_training(a, {"run": run}, {"control": control}, steps=10)
    assert [r.same for r in rows] == [True, False]
    assert "control" in capsys.readouterr().out
    with pytest.raises(ValueError, match="control"):
        compare_training(a, {"run": run}, {}, steps=10)
    # a run barely inside (2x) and a control barely outside fail the 10x margin
    tolerance = same_training_tolerance(10)
    with pytest.raises(AssertionError, match="inside"):
        compare_gaps({"run": tolerance / 2}, {"control": 100 * tolerance}, steps=10)
    with pytest.raises(AssertionError, match="outside"):
        compare_gaps({"run": tolerance / 100}, {"control": 2 * tolerance}, steps=10)
    with pytest.raises(AssertionError, match="control"):
        compare_gaps({"run": tolerance / 100}, {"control": tolerance / 2}, steps=10)


def test_different_weights_are_refused_by_name():
    a = weights(0)
    b = {k: v for k, v in a.items() if k != "ln_f.weight"}
    with pytest.raises(ValueError, match="ln_f.weight"):
        training_gap(a, b)

"""Chapter 1, section 5: accumulated micro-batches equal the large batch only when weighted n_i / N."""

import pytest
import torch

from dtbook.model import GPT, MODEL_SIZES

# Accumulation adds the same per-window contributions in another grouping and order, so it differs
# from the one-pass gradient by float32 rounding, which scales with the gradient: compare against
# the largest gradient entry. 1e-4 of it is about 800 float32 epsilons, far above any summation
# order on any CPU (measured: below 1e-7), and far below a wrong weighting.
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def rows(accumulation):
    args = accumulation.parse_args(["--model", "tiny", "--micro-batch-size", "3", "--accum-steps", "4",
                                    "--last-micro-batch", "1"])
    torch.manual_seed(0)
    model = GPT(MODEL_SIZES["tiny"])
    gen = torch.Generator().manual_seed(1)
    x, y = (torch.randint(256, (12, 64), generator=gen) for _ in "xy")
    return {r["case"]: r for r in accumulation.compare_splits(args, model, x, y)}


def relative(row):
    return row["max_abs_difference"] / row["max_abs_gradient"]


def test_every_case_is_compared(rows):
    assert sum(r["right"] for r in rows.values()) == 3 and len(rows) == 5
    assert rows["unequal micro-batches, loss / k"]["sizes"] == [3, 3, 3, 1]


@pytest.mark.parametrize("case", ["equal micro-batches, loss / k", "unequal micro-batches, loss x n_i / N",
                                  "short last group, loss x n_i / N"])
def test_weighting_by_n_i_over_n_reproduces_the_large_batch(rows, case):
    assert relative(rows[case]) <= TOLERANCE


@pytest.mark.parametrize("case", ["unequal micro-batches, loss / k", "short last group, loss / accum-steps"])
def test_dividing_by_the_number_of_micro_batches_fails_the_same_tolerance(rows, case):
    assert relative(rows[case]) > 100 * TOLERANCE


def test_a_short_last_group_divided_by_accum_steps_is_the_right_gradient_scaled_down(accumulation):
    """Two of four planned micro-batches divided by 4 give exactly half the gradient (up to rounding)."""
    torch.manual_seed(0)
    model = GPT(MODEL_SIZES["tiny"])
    x, y = (torch.randint(256, (4, 64), generator=torch.Generator().manual_seed(2)) for _ in "xy")
    right = accumulation.accumulated_gradients(model, x, y, [2, 2], [0.5, 0.5])
    buggy = accumulation.accumulated_gradients(model, x, y, [2, 2], [0.25, 0.25])
    largest = max(r.abs().max().item() for r in right)
    assert max((2 * b - r).abs().max().item() for b, r in zip(buggy, right, strict=True)) <= TOLERANCE * largest


def test_mean_loss_weights_are_each_micro_batch_s_share_of_the_windows(accumulation):
    assert accumulation.mean_loss_weights([4, 4, 2]) == [0.4, 0.4, 0.2]


@pytest.mark.parametrize("ranks", [2, 4])
def test_under_data_parallel_n_is_the_rank_s_batch_and_the_global_batch_is_ranks_times_too_small(
        accumulation, ranks):
    args = accumulation.parse_args(["--model", "tiny", "--micro-batch-size", "2", "--accum-steps", "4",
                                    "--last-micro-batch", "1", "--ranks", str(ranks)])
    torch.manual_seed(0)
    model = GPT(MODEL_SIZES["tiny"])
    gen = torch.Generator().manual_seed(1)
    x, y = (torch.randint(256, (8, 64), generator=gen) for _ in "xy")
    right, wrong = accumulation.compare_data_parallel(args, model, x, y)
    assert right["right"] and relative(right) <= TOLERANCE
    assert abs(right["norm_ratio"] - 1) < TOLERANCE
    assert not wrong["right"] and relative(wrong) > 100 * TOLERANCE
    assert abs(wrong["norm_ratio"] - ranks) < ranks * TOLERANCE


def test_ranks_must_divide_the_batch(accumulation):
    with pytest.raises(SystemExit):
        accumulation.parse_args(["--micro-batch-size", "4", "--accum-steps", "4", "--ranks", "3"])

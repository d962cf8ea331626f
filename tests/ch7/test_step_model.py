"""Chapter 7, section 2: the cost model of a DDP step, checked in-process against cases worked by hand.

The model (dtbook.cost_model.ddp_step_seconds) adds measured compute phases to the all-reduces of
chapter 2's alpha-beta model, overlapped with backward. Each case below has an answer that follows
from the model's two assumptions alone, so a wrong schedule fails one of them.
"""

from itertools import pairwise

import pytest

from dtbook.cost_model import AlphaBeta, bucket_schedule, ddp_step_seconds, naive_step_seconds

LINK = AlphaBeta(alpha_s=1e-3, beta_s_per_byte=1e-8)  # 1 ms per ring step, 100 MB/s
MIB = 2**20
FORWARD, OPTIMIZER = 0.02, 0.01


def comm(nbytes, world_size=2):
    return LINK.predict(nbytes, world_size)


def test_a_free_link_costs_nothing():
    free = AlphaBeta(0.0, 0.0)
    for step in (ddp_step_seconds, naive_step_seconds):
        assert step(FORWARD, 0.05, OPTIMIZER, [MIB, MIB], 3, free) == pytest.approx(0.08, rel=1e-12)


def test_one_bucket_cannot_overlap_and_costs_what_the_naive_loop_does():
    # The single bucket is ready only when backward ends: nothing hides it.
    backward = 0.05
    expected = FORWARD + backward + comm(4 * MIB) + OPTIMIZER
    assert ddp_step_seconds(FORWARD, backward, OPTIMIZER, [4 * MIB], 2, LINK) == \
        pytest.approx(expected, rel=1e-12)
    assert naive_step_seconds(FORWARD, backward, OPTIMIZER, [4 * MIB], 2, LINK) == \
        pytest.approx(expected, rel=1e-12)


def test_a_long_backward_hides_every_bucket_but_the_last():
    buckets = [MIB] * 4
    backward = 10.0  # each quarter of backward (2.5 s) outlasts a bucket's all-reduce
    expected = FORWARD + backward + comm(MIB) + OPTIMIZER
    assert ddp_step_seconds(FORWARD, backward, OPTIMIZER, buckets, 2, LINK) == \
        pytest.approx(expected, rel=1e-12)


def test_a_slow_link_queues_the_buckets_one_after_another():
    buckets = [MIB] * 4
    backward = 1e-4  # all buckets are ready almost at once; the link is the bottleneck
    schedule = bucket_schedule(backward, buckets, 2, LINK)
    assert schedule[-1][2] == pytest.approx(backward / 4 + 4 * comm(MIB), rel=1e-12)
    for (_, _, previous_end), (ready, start, end) in pairwise(schedule):
        assert start == max(ready, previous_end) and end > start


def test_bucket_ready_times_split_backward_by_bytes():
    schedule = bucket_schedule(0.3, [MIB, 2 * MIB], 2, LINK)
    assert [ready for ready, _, _ in schedule] == pytest.approx([0.1, 0.3], rel=1e-12)


def test_world_size_enters_through_the_ring_coefficients():
    # All-reduce on 3 processes: 4 alpha steps and 4/3 of the bytes, against 2 and 1 on 2.
    one = naive_step_seconds(0, 0, 0, [MIB], 3, LINK)
    assert one == pytest.approx(4 * LINK.alpha_s + 4 / 3 * MIB * LINK.beta_s_per_byte, rel=1e-12)


def test_overlap_beats_the_naive_loop_on_the_same_bytes():
    # Same bytes, same link: many per-tensor messages after backward against a few overlapped
    # buckets (the one-bucket test above is the case where the two are equal).
    tensors = [64 * 1024] * 64  # 4 MiB in 64 tensors
    naive = naive_step_seconds(FORWARD, 0.1, OPTIMIZER, tensors, 2, LINK)
    ddp = ddp_step_seconds(FORWARD, 0.1, OPTIMIZER, [MIB] * 4, 2, LINK)
    assert ddp < naive


def test_no_bytes_is_an_error():
    with pytest.raises(ValueError, match="at least one byte"):
        bucket_schedule(0.1, [], 2, LINK)

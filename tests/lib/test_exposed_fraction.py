"""The book's one exposed fraction, waited / T_comm, its bootstrap interval and its refusals.

Every sample here is synthetic with an answer known by construction (waited is a set share of
each step's T_comm, plus noise drawn with a fixed seed). Each refusal has a control: the same
samples with the one thing changed give a fraction, so a rule that refused everything (or
nothing) fails here.
"""

import random
import time

import pytest

from dtbook.exposed import (
    COMM_FLOOR,
    MIN_SAMPLES,
    WIDEST_INTERVAL,
    describe,
    exposed_fraction,
    first_look,
    reference_ratio,
    short,
)


def steps(n, share, comm_ms=20.0, noise=0.05, seed=1):
    """n paired steps: T_comm around comm_ms, waited = share * that step's T_comm, both noisy."""
    rng = random.Random(seed)
    comm = [comm_ms * rng.lognormvariate(0, noise) for _ in range(n)]
    waited = [share * c * rng.lognormvariate(0, noise) for c in comm]
    return waited, comm


def test_a_known_share_is_resolved_and_inside_its_interval():
    for share in (0.0, 0.3, 0.5, 1.0):
        waited, comm = steps(40, share)
        r = exposed_fraction(waited, comm, world_size=2)
        assert r["reason"] is None, r["reason"]
        assert r["low"] <= share <= r["high"]
        assert r["low"] <= r["fraction"] <= r["high"]
        assert r["high"] - r["low"] < 0.1
    assert describe(r) == f"{r['fraction']:.2f} (95% {r['low']:.2f}-{r['high']:.2f})"
    assert short(r) == f"{r['fraction']:.2f} ({r['low']:.2f}-{r['high']:.2f})"


def test_the_interval_narrows_with_more_steps():
    """The uncertainty of the ratio of medians, not the scatter of single steps."""
    widths = []
    for n in (10, 40, 160):
        waited, comm = steps(n, 0.5, noise=0.3)
        r = exposed_fraction(waited, comm, world_size=2)
        widths.append(r["high"] - r["low"])
    assert widths[0] > widths[1] > widths[2]
    assert widths[2] < widths[0] / 2


def test_same_samples_same_interval_and_fast_enough():
    waited, comm = steps(50, 0.4, noise=0.2)
    start = time.perf_counter()
    first = exposed_fraction(waited, comm, world_size=2)
    elapsed = time.perf_counter() - start
    assert first == exposed_fraction(waited, comm, world_size=2)
    assert elapsed < 2.0  # generous for two loaded cores; tens of ms when idle


def test_a_world_of_one_has_no_fraction():
    waited, comm = steps(20, 0.5)
    alone = exposed_fraction(waited, comm, world_size=1)
    assert alone["fraction"] is None and alone["reason"].startswith("one process")
    assert describe(alone).startswith("- (one process") and short(alone) == "-"
    assert exposed_fraction(waited, comm, world_size=2)["fraction"] is not None


def test_the_host_clock_on_cuda_gives_no_fraction():
    waited, comm = steps(20, 0.5)
    gpu = exposed_fraction(waited, comm, world_size=2, host_timed=False)
    assert gpu["fraction"] is None and "CUDA" in gpu["reason"]
    assert exposed_fraction(waited, comm, world_size=2, host_timed=True)["reason"] is None


def test_too_few_steps_for_a_bootstrap():
    waited, comm = steps(MIN_SAMPLES, 0.5)
    few = exposed_fraction(waited[:-1], comm[:-1], world_size=2)
    assert few["fraction"] is None and "fewer than" in few["reason"]
    # one step and two steps: no interval of zero width, no negative ends
    for n in (1, 2):
        assert exposed_fraction(waited[:n], comm[:n], world_size=2)["fraction"] is None
    # the control: one more step
    assert exposed_fraction(waited, comm, world_size=2)["reason"] is None


def test_an_unstable_communication_time_is_refused():
    # two modes, as gloo's small all-reduces on shared cores: half the steps 2 ms, half 20 ms
    rng = random.Random(2)
    comm = [rng.choice((2.0, 20.0)) * rng.lognormvariate(0, 0.05) for _ in range(40)]
    waited = [0.5 * c for c in comm]
    bimodal = exposed_fraction(waited, comm, world_size=2)
    assert bimodal["fraction"] is None and "T_comm unstable" in bimodal["reason"]
    assert "below half" in bimodal["reason"] and COMM_FLOOR == 0.5
    # the control: the same steps with every T_comm in the upper mode
    steady = [20.0 * rng.lognormvariate(0, 0.05) for _ in comm]
    r = exposed_fraction([0.5 * c for c in steady], steady, world_size=2)
    assert r["reason"] is None and r["low"] <= 0.5 <= r["high"]


def test_an_interval_that_says_nothing_is_refused():
    # waited anywhere from nothing to twice T_comm, independently of the step: median share 1
    rng = random.Random(3)
    comm = [20.0 * rng.lognormvariate(0, 0.05) for _ in range(20)]
    waited = [rng.uniform(0, 40.0) for _ in comm]
    wide = exposed_fraction(waited, comm, world_size=2)
    assert wide["fraction"] is None and "wider than" in wide["reason"]
    # the control: the same T_comm, waited a steady share of it
    tight = exposed_fraction([c * rng.uniform(0.95, 1.05) for c in comm], comm, world_size=2)
    assert tight["reason"] is None and tight["high"] - tight["low"] < WIDEST_INTERVAL


def test_unpaired_samples_are_an_error():
    with pytest.raises(ValueError, match="paired"):
        exposed_fraction([1.0] * 9, [2.0] * 10, world_size=2)


def test_the_first_look_is_not_labelled_a_95_percent_interval():
    look = first_look({"median": 30, "p25": 28, "p75": 33}, {"median": 20, "p25": 19, "p75": 22},
                      {"median": 10, "p25": 9, "p75": 11})
    assert describe(look) == f"1.00 ({look['low']:.2f}-{look['high']:.2f})"


def test_the_no_overlap_reference_keeps_a_wide_interval_above_one():
    # a loop waiting four times T_comm, noisily: not a fraction, but clearly above DDP's
    waited, comm = steps(30, 4.0, noise=0.3)
    ref = reference_ratio(waited, comm)
    assert ref["low"] <= 4.0 <= ref["high"] and ref["low"] > 1
    assert exposed_fraction(waited, comm, 2)["reason"] is not None  # too wide for a fraction
    assert reference_ratio(waited[:MIN_SAMPLES - 1], comm[:MIN_SAMPLES - 1])["low"] is None


def test_the_no_overlap_reference_is_refused_where_the_host_clock_misses_the_wait():
    """On CUDA the naive loop's wait is as invisible to the host as DDP's: no ratio, and the
    same reason exposed_fraction gives; the control, the same samples timed on the host."""
    waited, comm = steps(30, 4.0, noise=0.3)
    refused = reference_ratio(waited, comm, host_timed=False)
    assert refused["ratio"] is None and refused["low"] is None
    assert refused["reason"] == exposed_fraction(waited, comm, 2, host_timed=False)["reason"]
    assert reference_ratio(waited, comm)["ratio"] > 1


def test_the_first_look_brackets_its_value_when_the_difference_is_negative():
    # T_ddp below T_local, as noise makes it on shared cores: the worst cases are then over the
    # smaller T_comm for the low end; pairing p25/p75 with p75 alone put "low" above the value.
    ddp, local = {"median": 9.0, "p25": 8.0, "p75": 10.0}, {"median": 10.0, "p25": 9.5, "p75": 11.0}
    comm = {"median": 2.0, "p25": 1.0, "p75": 4.0}
    look = first_look(ddp, local, comm)
    assert look["low"] <= look["fraction"] <= look["high"]
    assert look["low"] == (8.0 - 11.0) / 1.0  # control: the old pairing gave (8 - 11) / 4 = -0.75

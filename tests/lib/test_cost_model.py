"""The alpha-beta model in dtbook.cost_model: its coefficients, its fit, its file (in-process, no torch)."""

import math
import random

import pytest

from dtbook.cost_model import (
    COLLECTIVES,
    AlphaBeta,
    Measurement,
    bus_bandwidth,
    gpipe_step_seconds,
    ring_coefficients,
    tensor_parallel_step_seconds,
)

ALPHA, BETA = 30e-6, 1 / 2.5e9  # 30 us per step, 2.5 GB/s
SIZES = [4 * 4**k for k in range(14)]  # 4 B to 256 MiB, as the benchmark sweeps them
WORLDS = (2, 4, 8)
NOISE = 0.05  # relative standard deviation of the synthetic timings


def synthetic(alpha, beta, noise, seed=0) -> list[Measurement]:
    """Times of every collective at every size and world size, from the model, with relative noise."""
    rng = random.Random(seed)
    model = AlphaBeta(alpha, beta)
    return [Measurement(c, n, s, model.predict(s, n, c) * (1 + noise * rng.gauss(0, 1)))
            for c in COLLECTIVES for n in WORLDS for s in SIZES]


def standard_errors(measurements, noise) -> tuple[float, float]:
    """Standard errors of the fitted alpha and beta that relative noise ``noise`` causes.

    The fit is least squares on rows (a/t, b*n/t) with target 1, and relative noise on t is
    noise on the target: the covariance of the estimate is noise^2 (X^T X)^-1.
    """
    rows = []
    for m in measurements:
        a, b = ring_coefficients(m.collective, m.world_size)
        rows.append((a / m.seconds, b * m.nbytes / m.seconds))
    suu, svv, suv = (sum(u * u for u, _ in rows), sum(v * v for _, v in rows), sum(u * v for u, v in rows))
    det = suu * svv - suv * suv
    return noise * math.sqrt(svv / det), noise * math.sqrt(suu / det)


def test_coefficients_are_the_ring_algorithms_and_nccl_tests_bus_factors():
    assert ring_coefficients("all_reduce", 4) == (6, 1.5)
    assert ring_coefficients("all_gather", 4) == ring_coefficients("reduce_scatter", 4) == (3, 0.75)
    assert ring_coefficients("broadcast", 4) == (3, 1.0)
    for collective in COLLECTIVES:  # one process: nothing to send, nothing to wait for
        assert ring_coefficients(collective, 1) == (0, 0)
    # busbw = algbw * factor: 1 GB all-reduced in 1 s on 8 ranks is 1.75 GB/s on the bus
    assert bus_bandwidth("all_reduce", 8, 1e9, 1.0) == pytest.approx(1.75e9)
    model = AlphaBeta(ALPHA, BETA)
    assert model.predict(2**20, 4, "all_reduce") == pytest.approx(6 * ALPHA + 1.5 * 2**20 * BETA)
    with pytest.raises(ValueError, match="unknown collective 'all_to_all'"):
        ring_coefficients("all_to_all", 4)


def test_fit_is_exact_on_noise_free_data():
    fitted = AlphaBeta.fit(synthetic(ALPHA, BETA, noise=0.0))
    assert fitted.alpha_s == pytest.approx(ALPHA, rel=1e-9)
    assert fitted.beta_s_per_byte == pytest.approx(BETA, rel=1e-9)


def test_fit_recovers_alpha_and_beta_within_the_noise_and_tells_a_different_beta_apart():
    data = synthetic(ALPHA, BETA, NOISE)
    se_alpha, se_beta = standard_errors(data, NOISE)
    fitted = AlphaBeta.fit(data)
    # Fitting relative errors with noisy times in the denominator is biased low by about 2 noise^2
    # (E[1/t] and E[1/t^2] grow by noise^2 and 3 noise^2): 0.5% here. On top of that bias, allow
    # 4 standard errors: a correct fit misses this by chance with probability about 6e-5 (and the
    # seeded noise makes the test deterministic besides).
    bias = 2 * NOISE**2
    assert abs(fitted.alpha_s - ALPHA * (1 - bias)) < 4 * se_alpha
    assert abs(fitted.beta_s_per_byte - BETA * (1 - bias)) < 4 * se_beta
    # The tolerance is tight enough to matter: data from a 10% slower link falls outside it.
    slower = AlphaBeta.fit(synthetic(ALPHA, 1.1 * BETA, NOISE, seed=1))
    assert abs(slower.beta_s_per_byte - BETA * (1 - bias)) > 4 * se_beta
    assert se_alpha < 0.05 * ALPHA and se_beta < 0.02 * BETA  # the synthetic sweep pins both down


def test_fit_never_returns_a_negative_latency():
    # Times that grow faster than linearly with size pull the unconstrained line below zero at
    # size zero; a negative alpha would predict negative times for small messages.
    data = [Measurement("all_reduce", 2, s, BETA * s * (1 + s / 2**28)) for s in SIZES[6:]]
    fitted = AlphaBeta.fit(data)
    assert fitted.alpha_s == 0.0 and fitted.beta_s_per_byte > BETA
    unconstrained_rows = [(2 / m.seconds, m.nbytes / m.seconds) for m in data]
    suu = sum(u * u for u, _ in unconstrained_rows)
    svv = sum(v * v for _, v in unconstrained_rows)
    suv = sum(u * v for u, v in unconstrained_rows)
    su, sv = sum(u for u, _ in unconstrained_rows), sum(v for _, v in unconstrained_rows)
    assert (su * svv - sv * suv) / (suu * svv - suv * suv) < 0, "the control: unconstrained alpha is negative"


def test_a_world_of_one_cannot_be_fitted():
    with pytest.raises(ValueError, match="2 or more processes"):
        AlphaBeta.fit([Measurement("all_reduce", 1, s, 1e-5) for s in SIZES])


def test_the_model_file_round_trips_and_refuses_other_json(tmp_path):
    model = AlphaBeta(ALPHA, BETA, {"backend": "gloo", "world_size": 2})
    model.save(tmp_path / "m.json")
    assert AlphaBeta.load(tmp_path / "m.json") == model
    (tmp_path / "other.json").write_text('{"alpha": 1}')
    with pytest.raises(ValueError, match="not an alpha-beta model file"):
        AlphaBeta.load(tmp_path / "other.json")


# ------------------------------------------------ section 8.8: model-parallel steps

def test_a_tensor_parallel_step_is_its_share_of_compute_plus_every_all_reduce():
    link = AlphaBeta(ALPHA, BETA)
    messages = [2**19] * 8  # 8 all-reduces of 512 KiB, as 8.8's 2-block model issues
    step = tensor_parallel_step_seconds(0.1, messages, 2, link)
    # N = 2: each all-reduce is 2 alpha-steps and sends its tensor once (2(N-1)/N = 1).
    assert step == pytest.approx(0.05 + 8 * (2 * ALPHA + 2**19 * BETA), rel=1e-12)
    # Control: a model that overlapped the all-reduces would predict the compute alone.
    assert step != pytest.approx(0.05, rel=1e-3)
    # Free communication leaves 1/N of the compute; a slower link only adds.
    assert tensor_parallel_step_seconds(0.1, messages, 4, AlphaBeta(0, 0)) == 0.025
    assert tensor_parallel_step_seconds(0.1, messages, 2, AlphaBeta(ALPHA, 10 * BETA)) > step
    # What is not split, every rank computes whole: 30% replicated on 2 ranks is 65%.
    free = AlphaBeta(0, 0)
    assert tensor_parallel_step_seconds(0.1, messages, 2, free, split=0.7) == pytest.approx(
        0.065, rel=1e-12)
    assert tensor_parallel_step_seconds(0.1, messages, 2, free, split=0.0) == 0.1
    with pytest.raises(ValueError, match="fraction of the compute"):
        tensor_parallel_step_seconds(0.1, messages, 2, free, split=1.5)


def test_a_gpipe_step_fills_and_drains_the_pipeline():
    link = AlphaBeta(ALPHA, BETA)
    forward, backward, m, p, message = 0.01, 0.02, 4, 2, 2**17
    step = gpipe_step_seconds(forward, backward, m, p, message, link)
    send = ALPHA + message * BETA  # one message between two ranks
    assert step == pytest.approx((m + p - 1) * (forward + backward) + 2 * (m + p - 2) * send,
                                 rel=1e-12)
    # One stage is one process: no bubble, no send.
    assert gpipe_step_seconds(forward, backward, m, 1, message, link) == pytest.approx(
        m * (forward + backward), rel=1e-12)
    # Without communication the bubble is what is left: (m+p-1)/m of the compute.
    free = gpipe_step_seconds(forward, backward, m, p, message, AlphaBeta(0, 0))
    assert free / (m * (forward + backward)) == pytest.approx((m + p - 1) / m, rel=1e-12)
    with pytest.raises(ValueError, match="at least one micro-batch"):
        gpipe_step_seconds(forward, backward, 0, p, message, link)

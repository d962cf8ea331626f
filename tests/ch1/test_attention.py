"""Chapter 1, section 4: SDPA against hand-written attention: same function, different memory."""

import pytest
import torch

from dtbook.measure import AtenOps, SavedTensors

CPU = torch.device("cpu")


@pytest.fixture
def args(attention):
    return attention.parse_args(["--model", "tiny", "--batch-size", "2", "--seq-lens", "32", "96"])


def test_sdpa_and_hand_written_attention_agree_and_the_unmasked_control_does_not(attention, args):
    """Tolerance: T float32 epsilons of the largest entry, the worst case for a sum of T terms."""
    rows = attention.compare(args, CPU)
    assert {(r["implementation"], r["tensor"]) for r in rows} == {
        (name, t) for name in ("hand-written", "control: no causal mask") for t in ("output", "dq", "dk", "dv")}
    for row in rows:
        if row["implementation"] == "hand-written":
            assert row["max_abs_difference"] <= row["tolerance"]
        else:
            assert row["max_abs_difference"] > 100 * row["tolerance"]


@pytest.mark.parametrize("seq_len", [32, 96])
def test_hand_written_attention_keeps_the_t_by_t_weights_and_sdpa_does_not(attention, args, seq_len):
    q, k, v = attention.random_qkv(args, seq_len, CPU)
    saved = {}
    for name, fn in attention.IMPLEMENTATIONS.items():
        with SavedTensors() as counted:
            fn(q, k, v)
        saved[name] = counted.bytes
    b, h, t, d = q.shape
    assert saved["hand-written"] - saved["SDPA"] == 4 * b * h * t * t + t * t - 4 * b * h * t * (d + 1)
    assert saved["SDPA, MATH backend"] >= 4 * b * h * t * t
    assert saved["SDPA"] == 4 * b * h * t * (4 * d + 1)  # q, k, v, output, one log-sum-exp per row


def test_sdpa_kernel_restricts_the_backend(attention, args):
    q, k, v = attention.random_qkv(args, 32, CPU)
    chosen, forced = AtenOps(), AtenOps()
    with chosen:
        attention.sdpa(q, k, v)
    with forced:
        attention.sdpa_math(q, k, v)
    # The MATH backend is composite: it decomposes into a matmul, a softmax and another matmul.
    assert {"bmm", "_safe_softmax"} <= forced.names()
    assert not {"bmm", "_safe_softmax"} & chosen.names()
    rows = attention.backends(args, CPU)
    working = {r["backend"] for r in rows if r["works"]}
    assert "MATH" in working
    if not torch.cuda.is_available():
        assert "EFFICIENT_ATTENTION" not in working and "CUDNN_ATTENTION" not in working


def test_sdpa_priority_order_is_the_one_aten_context_h_initialises_and_set_priority_restores(attention):
    import re
    from pathlib import Path

    header = (Path(torch.__file__).parent / "include" / "ATen" / "Context.h").read_text()
    block = re.search(r"sdp_priority_order = \{(.*?)\};", header, re.S)[1]
    in_source = [e.strip().removeprefix("at::SDPBackend::").upper() for e in block.split(",") if e.strip()]
    orders = attention.priority_orders()
    assert orders["default"] == in_source
    assert in_source.index("MATH") < in_source.index("CUDNN_ATTENTION")
    assert orders["cudnn and math first"][:2] == ["CUDNN_ATTENTION", "MATH"]
    assert orders["after"] == orders["default"]

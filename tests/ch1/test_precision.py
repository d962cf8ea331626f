"""Chapter 1, section 2: autocast's dtypes, fp16 underflow, and GradScaler's bookkeeping."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dtbook.model import GPT, MODEL_SIZES

CPU = torch.device("cpu")


@pytest.fixture
def args(precision):
    return precision.parse_args(["--model", "tiny", "--steps", "8", "--scaler-steps", "8",
                                 "--batch-size", "2", "--growth-interval", "2", "--inject-inf-at", "3"])


def batches(count, size=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randint(256, (size, 64), generator=gen) for _ in "xy"] for _ in range(count)]


def test_grad_scaler_skips_the_overflowing_step_halves_the_scale_and_grows_after_clean_steps(precision, args):
    rows = precision.scaler_run(args, batches(args.steps), CPU)
    s = args.init_scale
    # Two clean steps (1-2) double the scale; step 3 overflows: skipped, halved, and the count of
    # clean steps restarts; two more clean steps (4-5, then 6-7) double it again each time.
    used = [s, s, 2 * s, s, s, 2 * s, 2 * s, 4 * s]
    assert [r["scale"] for r in rows] == used
    assert [r["next_scale"] for r in rows] == used[1:] + [4 * s]
    assert [r["weights_changed"] for r in rows] == [True, True, False, True, True, True, True, True]


def test_without_the_injected_inf_no_step_is_skipped(precision, args):
    """The control: the same run with the inf after the last step skips nothing and only grows."""
    args.inject_inf_at = args.scaler_steps + 1
    rows = precision.scaler_run(args, batches(args.steps), CPU)
    assert all(r["weights_changed"] for r in rows)
    assert [r["next_scale"] / r["scale"] for r in rows] == [1, 2] * (args.steps // 2)


def test_fp16_gradients_underflow_without_a_scale_and_not_with_one(precision):
    torch.manual_seed(0)
    model = GPT(MODEL_SIZES["tiny"])
    x, y = batches(1, size=4)[0]
    # Tokens weighed as in a batch of 2**24: entries of about 1/256 / 2**24 lie below 2**-25.
    found = precision.underflow(model, x, y, scale=2.0**16, tokens_per_batch=2**24)
    assert found["dtype_in_backward"] == "torch.float16"
    assert found["reference_zero_fraction"] == 0
    assert found["zero_fraction_unscaled"] > 0.5
    assert found["zero_fraction_scaled"] == 0


def test_bf16_autocast_runs_matmuls_in_bf16_and_keeps_the_rest_in_fp32(precision, args):
    x, y = batches(1)[0]
    found = precision.op_dtypes(args, x, y, CPU)
    ran = {(row["op"], row["dtype"]) for row in found["forward_ops"]}
    assert {("addmm", "bfloat16"), ("mm", "bfloat16"), ("native_layer_norm", "float32"),
            ("_log_softmax", "float32"), ("add", "float32")} <= ran
    assert ("addmm", "float32") not in ran
    assert found["weight_dtype"] == found["grad_dtype"] == found["loss_dtype"] == "torch.float32"


def test_the_legacy_cuda_amp_spelling_is_deprecated(precision):
    warnings = precision.legacy_api_warnings()
    assert sum(w.startswith("FutureWarning") and "torch.amp" in w for w in warnings) == 2


class NoCpuOnlyOps(TorchDispatchMode):
    """The CUDA dispatcher's answer to ops that have no CUDA kernel, on the CPU.

    On an H100, ``torch.histogram`` raised NotImplementedError ('aten::histogram.bin_ct' ...
    'CUDA' backend) after the curves; the histograms are computed in ``underflow``.
    """

    CPU_ONLY = {torch.ops.aten.histogram.bin_ct, torch.ops.aten.histogram.bins_tensor}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.CPU_ONLY:
            raise NotImplementedError(f"Could not run '{func}' with arguments from the 'CUDA' backend")
        return func(*args, **(kwargs or {}))


def test_the_gradient_histogram_uses_no_op_that_cuda_lacks_and_bins_as_torch_histogram(precision):
    torch.manual_seed(0)
    model = GPT(MODEL_SIZES["tiny"])
    x, y = batches(1, size=4)[0]
    with NoCpuOnlyOps():  # the code path that crashed on the GPU, with the crash's cause armed
        found = precision.underflow(model, x, y, scale=2.0**16, tokens_per_batch=2**24)
    with pytest.raises(NotImplementedError), NoCpuOnlyOps():  # the control: the old call fails
        torch.histogram(torch.rand(8, dtype=torch.float64), bins=4)
    # The notebook's figure is unchanged: the same counts in the same bins as torch.histogram.
    gradient = precision.logits_gradient(model, x, y, None, x.numel() / 2**24)
    before = torch.histogram(torch.log2(gradient[gradient != 0].abs().double()), bins=60)
    assert found["log2_abs_gradient"] == before.hist.tolist()
    assert found["log2_abs_gradient_edges"] == before.bin_edges.tolist()

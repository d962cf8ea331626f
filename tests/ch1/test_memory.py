"""Chapter 1, section 1: the memory of a training step, measured, against the formulas."""

import dataclasses

import pytest
import torch

from dtbook.measure import SavedTensors, storage_bytes
from dtbook.model import GPT, MODEL_SIZES

CPU = torch.device("cpu")


def batch(cfg, size, seq_len, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(cfg.vocab_size, (size, seq_len), generator=gen) for _ in "xy"]


@pytest.mark.parametrize("model", ["tiny", "small"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_state_is_exactly_the_formula_and_activations_within_the_small_terms(memory, model, precision):
    """Parameters, gradients and AdamW state are exact; activations equal the term-by-term formula.

    Storage sizes involve no rounding, so nothing about them varies between CPUs: they depend only
    on which tensors the kernels save, which is why the full formula is asserted exactly. Its
    leading terms (16 BTC per block, the final layer norm, B T V for the log-softmax) must also
    account for everything but the small terms (layer-norm statistics, one log-sum-exp per row and
    head, the int64 token ids): the measured excess over them lies within those terms' size.
    """
    cfg = MODEL_SIZES[model]
    x, y = batch(cfg, 4, cfg.context)
    record = memory.measure_step(cfg, precision, x, y, seed=0, device=CPU, track_peaks=False)
    assert {k: record[k] for k in ("parameters", "gradients", "optimizer_state")} == \
        memory.state_formula(record["n_params"], record["n_param_tensors"])
    assert record["n_params"] == sum(p.numel() for p in GPT(cfg).parameters())

    terms = memory.activation_formula(cfg, 4, cfg.context, precision)
    assert record["activations"] == sum(terms.values())
    small = {"layer-norm statistics and attention logsumexp", "token ids, targets, positions (int64), loss weight"}
    leading = sum(size for term, size in terms.items() if term not in small)
    assert 0 < record["activations"] - leading <= sum(terms[t] for t in small)


def test_bf16_autocast_keeps_fp32_master_weights_and_saves_fewer_activation_bytes(memory):
    cfg = MODEL_SIZES["tiny"]
    x, y = batch(cfg, 4, cfg.context)
    fp32, bf16 = (memory.measure_step(cfg, p, x, y, 0, CPU, track_peaks=False) for p in ("fp32", "bf16"))
    assert bf16["param_dtype"] == bf16["grad_dtype"] == "torch.float32"
    assert bf16["optimizer_state"] == fp32["optimizer_state"]
    assert bf16["activations_by_dtype"]["bfloat16"] > 0
    assert 0.5 * fp32["activations"] < bf16["activations"] < fp32["activations"]


def test_set_to_none_lowers_the_peak_by_exactly_the_gradients(memory):
    """Two steps under MemTracker, after zero_grad in place and after set_to_none."""
    cfg = MODEL_SIZES["tiny"]
    x, y = batch(cfg, 2, cfg.context)
    record = memory.measure_step(cfg, "fp32", x, y, 0, CPU, track_peaks=True)
    kept, freed = record["memtracker_peak_zeroed_in_place"], record["memtracker_peak_set_to_none"]
    assert record["gradients_between_steps_zeroed_in_place"] == record["gradients"]
    assert record["gradients_between_steps_set_to_none"] == 0
    assert kept["Total"] - freed["Total"] == record["gradients"]
    assert kept["PARAM"] == freed["PARAM"] == record["parameters"]
    assert kept["OPT"] == record["optimizer_state"]


def test_activations_grow_with_batch_and_sequence_but_parameters_do_not(memory):
    cfg = dataclasses.replace(MODEL_SIZES["tiny"], context=128)
    rows = memory.activation_sweep(cfg, [(1, 64), (2, 64), (4, 64), (2, 32), (2, 128)], seed=0, device=CPU)
    assert len({r["parameters"] for r in rows}) == 1
    assert all(r["activations"] == r["formula"] for r in rows)
    by_batch = [r["activations"] for r in rows[:3]]
    by_seq = [rows[3]["activations"], rows[1]["activations"], rows[4]["activations"]]
    # Linear in B: only the positions (8 T bytes) and the loss's 4-byte weight do not scale with B.
    constant = 8 * 64 + 4
    assert by_batch[1] - constant == 2 * (by_batch[0] - constant)
    assert by_batch[2] - constant == 4 * (by_batch[0] - constant)
    assert by_seq == sorted(by_seq) and by_seq[2] < 2.1 * by_seq[1]  # SDPA: linear in T, no T^2


def test_saved_tensors_counts_each_storage_once_and_leaves_out_what_it_is_told():
    weight = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    with SavedTensors(exclude=[weight]) as saved:
        h = x @ weight       # saves x and weight
        q, k = h.split(4, dim=1)
        (q * k).sum()        # saves both views of h's one storage
    assert saved.bytes == storage_bytes([x, h]) == (4 * 8 + 4 * 8) * 4
    assert saved.bytes_by_dtype() == {"float32": saved.bytes}


def test_allocation_curve_adds_allocations_and_subtracts_completed_frees(memory):
    """The CUDA-only snapshot summary, on a hand-made trace in the allocator's format."""
    trace = [{"action": "segment_alloc", "size": 2048}, {"action": "alloc", "size": 512},
             {"action": "alloc", "size": 1024}, {"action": "free_requested", "size": 512},
             {"action": "free_completed", "size": 512}, {"action": "alloc", "size": 256}]
    assert memory.allocation_curve({"device_traces": [[], trace]}, 1) == [512, 1536, 1024, 1280]
    long_trace = [{"action": "alloc", "size": 1}] * 10
    assert memory.allocation_curve({"device_traces": [long_trace]}, 0, max_points=5) == [1, 3, 5, 7, 9]


def test_the_snapshots_segment_totals_add_up_its_segments(memory):
    """The CUDA-only --snapshot path's summary, on a snapshot shaped like torch.cuda.memory._snapshot()."""
    snapshot = {"segments": [{"total_size": 2 << 20, "allocated_size": 1536 << 10},
                             {"total_size": 20 << 20, "allocated_size": 20 << 20}]}
    assert memory.segment_totals(snapshot) == {"segments": 2, "reserved_bytes": 22 << 20,
                                               "allocated_bytes": (1536 << 10) + (20 << 20),
                                               "free_bytes": 512 << 10}

"""The contract of scripts/ch4_fsdp.py that no notebook run covers: refusals of bad input.

Process launches are what costs time on two cores, and the chapter's notebooks, which the quick book
build runs in `make test`, already launch the programs and assert every claim of the chapter, each
comparison with a control that must fail it:

- FSDP2 and FSDP1, full and grad-op sharding (and ZeRO-1, root-only, hybrid, no-shard) equal to DDP:
  sections 1 and 4 after two steps, section 3 for whole runs of ch4_fsdp.py, HSDP included;
- the hand-written ZeRO-1 optimizer and minimal FSDP equal to their references: section 2;
- per-rank memory against the formulas (exact, ZeRO-1 within one parameter) and the communication
  derivation (exact): sections 1 and 4;
- a DCP checkpoint saved by 4 processes, loaded by 2 and by 1 (FSDP1), with the same losses: section 5;
- an exact (torch.equal) resume after SIGKILL with dropout, accumulation, activation
  checkpointing, CPU offload and meta-device initialization, across an epoch boundary: section 5;
- FSDP2 with --grad-clip on two processes clipping by the norm one process computes, and FSDP2
  with --compile aot_eager equal to eager FSDP2: section 3;
- ch4_knobs.py on four processes (int reshard_after_forward, set_reshard_after_backward, the
  MixedPrecisionPolicy fields and autocast, shard_placement_fn, CPUOffloadPolicy's step time): section 3;
- a non-persistent buffer after to_empty, not restored by a checkpoint: section 6 (ch4_pitfalls.py).

The tests here check what those runs cannot: every impossible combination refused in one line, in
process; one refusal end to end; the size-based wrap policy in a world of one; the ring formulas;
FSDP1's clip (the wrapper's own clip_grad_norm_) against FSDP2's; ch4_knobs.py's refusal of a world
too small for an int reshard.
"""

import math

import pytest
import torch

from dtbook.cli import ScriptError
from dtbook.collectives import ring_traffic
from dtbook.compare import GAP_PER_STEP
from dtbook.metrics import read_metrics
from dtbook.ports import free_port
from support import load_script, run_python, run_torchrun

SCRIPT = "ch4_fsdp.py"


@pytest.fixture(scope="module")
def program():
    return load_script(SCRIPT)


@pytest.mark.parametrize("args, world, local, on_gpu, problem", [
    (["--sharding", "no_shard"], 2, 2, False, "FSDP2 has no no_shard"),
    (["--wrap", "size"], 2, 2, False, "--wrap size is an FSDP1"),
    (["--sharding", "hybrid"], 3, 2, False, "cannot build a mesh"),
    (["--sharding", "hybrid", "--shard-group-size", "2"], 6, 6, False, None),
    (["--sharding", "hybrid", "--shard-group-size", "4"], 6, 6, False, "do not split into shard groups of 4"),
    (["--sharding", "hybrid", "--shard-group-size", "4"], 2, 2, False, "cannot build a mesh"),
    (["--shard-group-size", "2"], 4, 4, False, "only applies to --sharding hybrid"),
    (["--api", "fsdp1", "--cpu-offload"], 2, 2, False, "needs CUDA"),
    (["--api", "fsdp1", "--cpu-offload"], 2, 2, True, None),
    (["--api", "fsdp2", "--cpu-offload"], 2, 2, False, None),
    (["--api", "fsdp1", "--meta-init"], 2, 2, False, "--meta-init"),
    (["--api", "fsdp1", "--compile", "aot_eager"], 2, 2, False, "does not compile FSDP1"),
    (["--compile", "aot_eager", "--grad-clip", "1"], 2, 2, False, None),
    (["--api", "fsdp1", "--sharding", "no_shard"], 2, 2, False, None),
    (["--batch-size", "5000"], 2, 2, False, "corpus has only"),
    (["--crash-at-step", "3", "--crash-rank", "2"], 2, 2, False, "--crash-rank 2"),
])
def test_impossible_combinations_are_refused(program, args, world, local, on_gpu, problem):
    parsed = program.parse_args(args)
    if problem is None:
        program.check_inputs(parsed, world, local, 2499, on_gpu)
        return
    with pytest.raises(ScriptError, match=problem) as refused:
        program.check_inputs(parsed, world, local, 2499, on_gpu)
    assert "\n" not in str(refused.value)


def test_hybrid_shard_group_defaults_to_one_node(program):
    parsed = program.parse_args(["--sharding", "hybrid"])
    program.check_inputs(parsed, 8, 4, 2499, False)
    assert parsed.shard_group_size == 4


@pytest.mark.parametrize("args, problem", [
    (["--resume"], "--resume needs --checkpoint-dir"),
    (["--async-save"], "--async-save needs --checkpoint-dir"),
    (["--sharding", "zero3"], "invalid choice"),
    (["--dropout", "1.5"], "--dropout"),
    (["--grad-clip", "0"], "argument --grad-clip: must be a finite number greater than 0"),
    (["--grad-clip", "-1"], "argument --grad-clip: must be a finite number greater than 0"),
    (["--grad-clip", "inf"], "argument --grad-clip: must be a finite number greater than 0"),
    (["--compile", "max-autotune"], "argument --compile: invalid choice"),
])
def test_bad_flags_are_refused_by_the_parser(program, args, problem, capsys):
    with pytest.raises(SystemExit) as exit_info:
        program.parse_args(args)
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and problem in errors[0]


def test_a_refused_combination_is_one_line_and_a_nonzero_exit():
    done = run_python(SCRIPT, "--model", "tiny", "--sharding", "no_shard", check=False, timeout=120)
    errors = [line for line in done.output.splitlines() if "error:" in line]
    assert done.returncode == 2
    assert len(errors) == 1 and "no_shard" in errors[0]
    assert "Traceback" not in done.output


@pytest.mark.parametrize("kind, group, expected", [
    ("all_reduce", 4, 2 * 3 / 4 * 1000),
    ("all_gather", 4, 3 / 4 * 1000),
    ("reduce_scatter", 2, 1 / 2 * 1000),
    ("broadcast", 1, 0.0),
    ("send", 2, 1000.0),  # point to point (8.8's pipeline, 8.5's ring): all of it leaves
    ("send", 8, 1000.0),
])
def test_ring_traffic(kind, group, expected):
    assert ring_traffic(kind, 1000, group) == expected


@pytest.fixture
def world_of_one(monkeypatch):
    """This test process as a world of one, so a wrapper can be built without launching anything."""
    import torch.distributed as dist

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_size_policy_never_separates_the_tied_weight(program, world_of_one):
    from dtbook.model import GPT, MODEL_SIZES

    args = program.parse_args(["--api", "fsdp1", "--wrap", "size", "--min-wrap-params", "5000"])
    torch.manual_seed(0)
    model = program.shard_fsdp1(GPT(MODEL_SIZES["tiny"]), args, None, torch.device("cpu"))
    units = program.describe_units(model)
    # The plain size policy would make the head (8192 parameters) a unit of its own.
    assert units == ["", "blocks.0.mlp", "blocks.1.mlp"], units
    tokens = torch.zeros(1, 8, dtype=torch.long)
    assert model(tokens, tokens).isfinite()


@pytest.fixture(scope="module")
def footprint():
    return load_script("ch4_footprint.py")


def test_footprint_counts_only_the_training_devices_memory(footprint):
    """Host tensors are not device memory: on an H100, fsdp2_offload once measured as fsdp2_full."""
    here, elsewhere = torch.ones(256), torch.ones(1024, device="meta")  # meta: another device
    assert footprint.storage_bytes([here, elsewhere, here[:8]], torch.device("cpu")) == 1024
    with footprint.LiveMemory(torch.device("cpu")) as memory:
        kept = [torch.zeros(64), torch.zeros(4096, device="meta")]
        assert memory.live() == 256 and kept


def test_live_memory_records_the_operator_that_reached_the_peak(footprint):
    """4.4 reads what was gathered at the peak from on_peak; it must fire at the peak, not later."""
    with footprint.LiveMemory(torch.device("cpu")) as memory:
        memory.on_peak = lambda func: str(func)
        big = torch.ones(4096)
        del big
        kept = torch.zeros(16)
    assert memory.peak == 4096 * 4 and kept.numel() == 16
    assert memory.at_peak == "aten.ones.default"  # not the later, smaller zeros


def test_offload_that_left_state_on_the_device_is_an_error(footprint):
    offloaded = {"params": 0, "grads": 0, "optimizer": 0,
                 "host": {"params": 482_304, "grads": 482_304, "optimizer": 964_608}}
    footprint.check_offload(offloaded)
    # What the H100 reported on 2026-11-26, when host tensors counted as device memory.
    not_offloaded = {**offloaded, "params": 482_304, "optimizer": 964_608,
                     "host": {"params": 0, "grads": 0, "optimizer": 0}}
    with pytest.raises(RuntimeError, match="left state on the device"):
        footprint.check_offload(not_offloaded)


def test_fsdp1_clips_by_the_same_norm_as_fsdp2(tmp_path):
    """FSDP1's model.clip_grad_norm_ all-reduces its shards' norms: it clips by the norm FSDP2 clips
    by, step by step. Section 4.3 shows FSDP2 on two processes equal to FSDP2 as a world of one, the
    whole gradient in one process; that run (no launcher to start) is the reference here too."""
    common = ["--model", "tiny", "--max-steps", "4", "--grad-clip", "0.1"]
    norms = {}
    for api, launch, batch in (("fsdp2", run_python, "32"), ("fsdp1", run_torchrun, "16")):
        metrics = tmp_path / f"{api}.jsonl"
        launch(SCRIPT, "--api", api, *common, "--batch-size", batch, "--metrics", metrics, timeout=120)
        norms[api] = {r["step"]: r for r in read_metrics(metrics) if r["event"] == "grad_norm"}
    assert norms["fsdp1"].keys() == norms["fsdp2"].keys() == {1, 2, 3, 4}
    for step, whole in norms["fsdp2"].items():
        fsdp1 = norms["fsdp1"][step]
        # another order of additions, compounding over the steps: dtbook.compare's allowance per
        # step, relative to the norm
        tolerance = GAP_PER_STEP * step * whole["total"]
        assert whole["total"] > 0.1, "clipping acts, so every step depends on the norm"
        assert abs(fsdp1["total"] - whole["total"]) <= tolerance, step
        assert abs(math.hypot(*fsdp1["local_by_rank"]) - fsdp1["total"]) <= tolerance, step
        # every rank scaled by the whole norm's factor: together the shards now have norm 0.1
        assert abs(math.hypot(*fsdp1["clipped_by_rank"]) - 0.1) <= GAP_PER_STEP * step * 0.1, step
        # the control: the norm torch.nn.utils.clip_grad_norm_ would use on an FSDP1 model
        assert all(whole["total"] - local > tolerance for local in fsdp1["local_by_rank"]), step


def test_knobs_refuse_a_world_too_small_for_an_int_reshard_in_one_line():
    done = run_python("ch4_knobs.py", check=False, timeout=120)
    errors = [line for line in done.output.splitlines() if "error:" in line]
    assert done.returncode == 2
    assert len(errors) == 1 and "even world size of at least 4, not 1" in errors[0]
    assert "Traceback" not in done.output

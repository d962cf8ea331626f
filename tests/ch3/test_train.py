"""The contract of scripts/ch3_train.py: equivalence across layouts, exact resume, clear errors."""

import json

import pytest
import torch

from dtbook.compare import compare_training
from support import run_in_process, run_python, run_torchrun

SCRIPT = "ch3_train.py"
# The tiny model on a short corpus: 19 optimizer steps per epoch at a global batch of 16,
# so the runs below cross an epoch boundary within a few seconds.
TINY = ["--model", "tiny", "--corpus-tokens", "20000", "--log-every", "2"]


def load_weights(path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_global_batch_alone_decides_the_result(tmp_path):
    """1 x 16, 2 x 8 and 2 x 4 x 2 accumulation steps train the same model; 1 x 8 does not."""
    steps = ["--max-steps", "8"]
    run_python(SCRIPT, *TINY, *steps, "--batch-size", "16", "--save-final", tmp_path / "one.pt")
    run_torchrun(SCRIPT, *TINY, *steps, "--batch-size", "8", "--save-final", tmp_path / "two.pt")
    run_torchrun(SCRIPT, *TINY, *steps, "--batch-size", "4", "--accum-steps", "2",
                 "--save-final", tmp_path / "accum.pt")
    run_python(SCRIPT, *TINY, *steps, "--batch-size", "8", "--save-final", tmp_path / "half.pt")

    one, two, accum, half = (load_weights(tmp_path / f"{n}.pt") for n in ("one", "two", "accum", "half"))
    compare_training(one, {"2 x 8": two, "2 x 4 x 2": accum}, {"1 x 8 (half the batch)": half}, steps=8)
    compare_training(two, {"2 x 4 x 2": accum}, {"1 x 8 (half the batch)": half}, steps=8)


def test_resume_after_sigkill_is_bit_identical(tmp_path):
    """Kill rank 1 after step 17 (checkpoints at 7 and 14), resume, end exactly where an unbroken run ends.

    Dropout is on, so the per-rank RNG states must be restored too; accumulation and bf16 autocast
    are on, and the run crosses an epoch boundary, so the sampler position must be right as well.
    """
    config = [*TINY, "--max-steps", "25", "--batch-size", "4", "--accum-steps", "2", "--dropout", "0.1",
              "--amp", "bf16", "--save-every", "7", "--keep", "2"]
    ckpt_dir = tmp_path / "ckpt"
    run_torchrun(SCRIPT, *config, "--save-final", tmp_path / "unbroken.pt")

    crashed = run_torchrun(SCRIPT, *config, "--checkpoint-dir", ckpt_dir, "--crash-at-step", "17",
                           "--crash-rank", "1", check=False)
    assert crashed.returncode != 0
    assert "fault injection: SIGKILL after step 17" in crashed.output
    assert sorted(p.name for p in ckpt_dir.glob("ckpt_step*.pt")) == ["ckpt_step00000007.pt",
                                                                       "ckpt_step00000014.pt"]
    assert not (tmp_path / "resumed.pt").exists()

    metrics = tmp_path / "resumed.jsonl"
    run_torchrun(SCRIPT, *config, "--checkpoint-dir", ckpt_dir, "--resume", "--save-final", tmp_path / "resumed.pt",
                 "--metrics", metrics)
    records = read_jsonl(metrics)
    assert [r["step"] for r in records if r["event"] == "resume"] == [14]
    assert min(r["step"] for r in records if r["event"] == "step") > 14

    unbroken, resumed = load_weights(tmp_path / "unbroken.pt"), load_weights(tmp_path / "resumed.pt")
    assert unbroken.keys() == resumed.keys()
    different = [k for k in unbroken if not torch.equal(unbroken[k], resumed[k])]
    assert not different, f"resumed run differs in {different}"
    # Rotation kept the two newest: the final checkpoint (25) and the one before it (21).
    assert sorted(p.name for p in ckpt_dir.glob("ckpt_step*.pt")) == ["ckpt_step00000021.pt",
                                                                       "ckpt_step00000025.pt"]


def test_corrupt_newest_checkpoint_falls_back_to_previous(tmp_path):
    """Truncate the newest checkpoint: --resume reports it, uses the previous one, and still ends exactly.

    The first run also shows that --resume on an empty directory starts from step 0 (the Slurm job
    relies on that: one command line for the first launch and every restart).
    """
    config = [*TINY, "--max-steps", "12", "--batch-size", "8", "--save-every", "4", "--keep", "3"]
    ckpt_dir = tmp_path / "ckpt"
    first = run_python(SCRIPT, *config, "--checkpoint-dir", ckpt_dir, "--resume", "--save-final",
                       tmp_path / "unbroken.pt", "--metrics", tmp_path / "first.jsonl")
    assert "no checkpoint in" in first.output
    first_records = read_jsonl(tmp_path / "first.jsonl")
    assert not [r for r in first_records if r["event"] == "resume"]
    assert [r["step"] for r in first_records if r["event"] == "step"][0] == 2
    assert sorted(p.name for p in ckpt_dir.glob("ckpt_step*.pt")) == [f"ckpt_step{s:08d}.pt" for s in (4, 8, 12)]
    newest = ckpt_dir / "ckpt_step00000012.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])

    metrics = tmp_path / "resumed.jsonl"
    done = run_python(SCRIPT, *config, "--checkpoint-dir", ckpt_dir, "--resume", "--save-final",
                      tmp_path / "resumed.pt", "--metrics", metrics)
    warnings = [line for line in done.output.splitlines() if "ckpt_step00000012.pt" in line]
    assert len(warnings) == 1 and "unreadable" in warnings[0]
    assert "Traceback" not in done.output
    assert [r["step"] for r in read_jsonl(metrics) if r["event"] == "resume"] == [8]
    unbroken, resumed = load_weights(tmp_path / "unbroken.pt"), load_weights(tmp_path / "resumed.pt")
    assert all(torch.equal(unbroken[k], resumed[k]) for k in unbroken)


@pytest.fixture
def corrupt_only_dir(tmp_path):
    ckpt_dir = tmp_path / "corrupt"
    ckpt_dir.mkdir()
    (ckpt_dir / "ckpt_step00000005.pt").write_bytes(b"PK\x03\x04 not really a checkpoint")
    return ckpt_dir


@pytest.fixture
def file_in_the_way(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    return blocker / "ckpt"


@pytest.mark.parametrize("args, problem", [
    (["--batch-size", "0"], "--batch-size"),
    (["--max-steps", "-3"], "--max-steps"),
    (["--lr", "0"], "--lr"),
    (["--accum-steps", "0"], "--accum-steps"),
    (["--backend", "nccl"], "nccl"),
    (["--corpus-tokens", "500"], "corpus has only"),
    (["--resume"], "--checkpoint-dir"),
    (["--checkpoint-dir", "FILE_IN_THE_WAY"], "cannot write to --checkpoint-dir"),
])
def test_bad_input_gives_one_line_error(args, problem, file_in_the_way, monkeypatch, capsys):
    """Inputs refused before the process group exists, checked in-process (see the next test for a real run)."""
    if torch.cuda.is_available() and "nccl" in args:
        pytest.skip("this machine has GPUs, so nccl is valid")
    args = [file_in_the_way if a == "FILE_IN_THE_WAY" else a for a in args]
    code = run_in_process(SCRIPT, "--model", "tiny", "--max-steps", "2", *args, monkeypatch=monkeypatch)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert code == 2
    assert len(errors) == 1 and problem in errors[0], err
    assert "Traceback" not in err


def test_unreadable_checkpoints_are_one_line_in_a_real_run(corrupt_only_dir):
    """The same contract end to end, for a check that needs the process group (rank 0 decides)."""
    done = run_python(SCRIPT, "--model", "tiny", "--max-steps", "2", "--checkpoint-dir", corrupt_only_dir,
                      "--resume", check=False)
    errors = [line for line in done.output.splitlines() if "error:" in line]
    assert done.returncode == 2
    assert len(errors) == 1 and "can be read" in errors[0], done.output
    assert "Traceback" not in done.output


def test_each_rank_prefixes_its_error():
    """Each rank of a failing world prints its own one-line error, prefixed with its rank.

    The ranks run as two plain processes with torchrun's variables set: under torchrun the agent
    stops the other workers as soon as it sees one fail, so whether a second rank gets to print
    depends on how fast it started (a CI run on two busy cores lost rank 0's line that way).
    """
    outputs = [run_python(SCRIPT, "--model", "tiny", "--corpus-tokens", "500", check=False,
                          env={"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"})
               for rank in (0, 1)]
    for rank, done in enumerate(outputs):
        assert done.returncode == 2
        errors = [line for line in done.output.splitlines() if "error:" in line]
        assert len(errors) == 1
        assert errors[0].startswith(f"[rank {rank}] error: one optimizer step needs 2 process(es)")
        assert "Traceback" not in done.output


def test_torchrun_reports_the_first_failing_rank():
    """Under torchrun the run exits non-zero with a rank's one-line error and no traceback wall."""
    done = run_torchrun(SCRIPT, "--model", "tiny", "--corpus-tokens", "500", check=False)
    assert done.returncode != 0
    errors = [line for line in done.output.splitlines() if "error: one optimizer step needs" in line]
    assert errors and all(line.startswith(("[rank 0] ", "[rank 1] ")) for line in errors)
    assert "Traceback" not in done.output


def test_help_lists_the_contract(monkeypatch, capsys):
    assert run_in_process(SCRIPT, "--help", monkeypatch=monkeypatch) == 0
    out = capsys.readouterr().out
    for flag in ("--epochs", "--max-steps", "--batch-size", "--accum-steps", "--lr", "--seed", "--amp",
                 "--bucket-cap-mb", "--backend", "--checkpoint-dir", "--save-every", "--keep", "--resume",
                 "--metrics", "--crash-at-step", "--print-every"):
        assert flag in out


@pytest.fixture(scope="module")
def precision_runs(tmp_path_factory):
    """One process without a launcher, 32 steps, in fp32, bf16 and fp16."""
    out = tmp_path_factory.mktemp("amp")
    runs = {}
    for amp in ("off", "bf16", "fp16"):
        run_python(SCRIPT, *TINY, "--max-steps", "32", "--amp", amp, "--metrics", out / f"{amp}.jsonl")
        runs[amp] = read_jsonl(out / f"{amp}.jsonl")
    return runs


def test_metrics_record_provenance_steps_and_summary(precision_runs):
    records = precision_runs["off"]
    assert records[0]["event"] == "provenance" and records[0]["world_size"] == 1
    steps = [r for r in records if r["event"] == "step"]
    assert [r["step"] for r in steps] == list(range(2, 33, 2))
    # samples/s is the global batch (16 windows, one process) over the measured step time
    assert all(r["samples_per_s"] == pytest.approx(16 / r["step_time_s"]) for r in steps)
    summary = records[-1]
    assert summary["event"] == "summary" and summary["steps"] == 32
    assert summary["final_loss"] == steps[-1]["loss"]
    assert summary["final_loss"] < 0.7 * steps[0]["loss"], "the loss should clearly fall"
    assert len(summary["weights_sha256"]) == 64


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_mixed_precision_on_cpu_tracks_fp32(precision_runs, amp):
    """bf16 autocast, and fp16 autocast with a GradScaler, both train correctly on the CPU."""
    reference = [r["loss"] for r in precision_runs["off"] if r["event"] == "step"]
    steps = [r for r in precision_runs[amp] if r["event"] == "step"]
    losses = [r["loss"] for r in steps]
    assert losses[-1] < 0.7 * losses[0]
    assert all(abs(a - b) < 0.05 * b for a, b in zip(losses, reference, strict=True)), (losses, reference)
    assert precision_runs[amp][-1]["weights_sha256"] != precision_runs["off"][-1]["weights_sha256"]
    if amp == "fp16":
        assert all(r["grad_scale"] > 0 for r in steps)

"""The contract of scripts/ch6_lightning.py and ch6_fabric.py: chapter 3's training, exact resume, clear errors.

The two-process comparisons run in the chapter's notebooks (`make test` executes them); these tests
check the same properties in a world of one, mostly inside this process: a Lightning run of a few
steps takes a fraction of a second once Lightning is imported, a fresh process takes seconds.
"""

import difflib
import json
import sys

import pytest
import torch
import torch.distributed as dist

from dtbook.compare import compare_training
from dtbook.paths import SCRIPTS_DIR
from support import LAUNCHER_VARIABLES, load_script, run_in_process, run_python

LIGHTNING, FABRIC = "ch6_lightning.py", "ch6_fabric.py"
# 20 optimizer steps per epoch at a global batch of 16 (320 windows): nothing is left over,
# so accumulation and a larger batch see the same windows in every step.
TINY = ["--model", "tiny", "--corpus-tokens", 320 * 64 + 1, "--log-every", 2]


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def load_weights(path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


@pytest.fixture(scope="module")
def lightning_script():
    """The script as a module, imported once (importing Lightning takes seconds)."""
    return load_script(LIGHTNING)


@pytest.fixture
def train_here(lightning_script, monkeypatch):
    """Run the script's main in this process, a world of one; returns its final weights.

    Lightning creates a one-process gloo group on the first run and reuses it after; the
    group and the variables Lightning exports are removed afterwards.
    """
    for name in (*LAUNCHER_VARIABLES, "PL_GLOBAL_SEED", "NODE_RANK"):
        monkeypatch.setenv(name, "")  # so that monkeypatch restores the variable's absence
        monkeypatch.delenv(name)

    def train(path, *args):
        monkeypatch.setattr(sys, "argv", [LIGHTNING, *map(str, TINY), *map(str, args),
                                          "--save-final", str(path)])
        lightning_script.main()
        return load_weights(path)

    yield train
    if dist.is_initialized():
        dist.destroy_process_group()


def test_trains_what_ch3_trains_and_accumulation_is_a_larger_batch(train_here, tmp_path):
    """ch3_train.py 8 x 2 accumulation = Lightning 8 x 2 = Lightning 16; Lightning 8 x 1 is another run."""
    steps = ["--max-steps", 6]
    run_python("ch3_train.py", *TINY, *steps, "--batch-size", 8, "--accum-steps", 2,
               "--save-final", tmp_path / "ch3.pt")
    ch3 = load_weights(tmp_path / "ch3.pt")
    accum = train_here(tmp_path / "accum.pt", *steps, "--batch-size", 8, "--accum-steps", 2,
                       "--sampler", "book")
    larger = train_here(tmp_path / "larger.pt", *steps, "--batch-size", 16)
    half = train_here(tmp_path / "half.pt", *steps, "--batch-size", 8)

    # The control: half the global batch is a different training, and the tolerance sees it.
    compare_training(accum, {"ch3_train.py 8 x 2": ch3, "Lightning 16": larger},
                     {"Lightning 8 (half the batch)": half}, steps=6)


def test_gradient_clipping_caps_the_norm(train_here, tmp_path):
    metrics = tmp_path / "clip.jsonl"
    train_here(tmp_path / "clip.pt", "--max-steps", 4, "--batch-size", 16, "--grad-clip", 0.05,
               "--metrics", metrics)
    clips = [r for r in read_jsonl(metrics) if r["event"] == "clip"]
    assert [r["step"] for r in clips] == [2, 4]
    for record in clips:
        # At this max_norm every step is clipped: the norm after is max_norm, up to the
        # 1e-6 that clip_grad_norm_ adds to the divisor and float32 rounding.
        assert record["norm_before"] > record["max_norm"]
        assert record["norm_after"] == pytest.approx(record["max_norm"], rel=1e-4)


def test_fp16_on_a_cpu_trains_what_bf16_trains(train_here, tmp_path):
    """16-mixed on a CPU is bf16-mixed (section 6.2 shows the readback); fp32 is the control."""
    metrics = tmp_path / "fp16.jsonl"
    steps = ["--max-steps", 4, "--batch-size", 16]
    fp16 = train_here(tmp_path / "fp16.pt", *steps, "--amp", "fp16", "--metrics", metrics)
    bf16 = train_here(tmp_path / "bf16.pt", *steps, "--amp", "bf16")
    fp32 = train_here(tmp_path / "fp32.pt", *steps)
    setup = next(r for r in read_jsonl(metrics) if r["event"] == "lightning_setup")
    assert setup["precision"] == "bf16-mixed"
    assert all(torch.equal(fp16[k], bf16[k]) for k in fp16)
    assert not all(torch.equal(fp16[k], fp32[k]) for k in fp16)


def test_resume_with_a_resumable_loader_is_bit_identical(tmp_path):
    """SIGKILL after step 17 (checkpoints at 7 and 14, mid-epoch), resume: the unbroken run's weights.

    All three runs are separate processes with one thread each: bit-identical claims need the
    same thread count (this test process has others) and MKL's path pinned from the start.
    """
    config = ["--max-steps", 24, "--batch-size", 8, "--save-every", 7, "--sampler", "resumable"]
    run_python(LIGHTNING, *TINY, *config, "--save-final", tmp_path / "unbroken.pt")

    ckpt_dir = tmp_path / "ckpt"
    crashed = run_python(LIGHTNING, *TINY, *config, "--checkpoint-dir", ckpt_dir,
                         "--crash-at-step", 17, check=False)
    assert crashed.returncode != 0
    assert "fault injection: SIGKILL after step 17" in crashed.output
    metrics = tmp_path / "resumed.jsonl"
    run_python(LIGHTNING, *TINY, *config, "--checkpoint-dir", ckpt_dir, "--resume",
               "--save-final", tmp_path / "resumed.pt", "--metrics", metrics)

    resumes = [r for r in read_jsonl(metrics) if r["event"] == "resume"]
    assert [(r["step"], r["epoch"]) for r in resumes] == [(14, 0)]
    unbroken, resumed = load_weights(tmp_path / "unbroken.pt"), load_weights(tmp_path / "resumed.pt")
    different = [k for k in unbroken if not torch.equal(unbroken[k], resumed[k])]
    assert not different, f"resumed run differs in {different}"


SLURM_TASK = {"SLURM_JOB_NAME": "ch6-lightning", "SLURM_NTASKS": "4", "SLURM_NNODES": "2",
              "SLURM_PROCID": "3"}


@pytest.mark.parametrize("variables, shape, rank", [
    ({}, (1, 1), 0),                                              # plain python
    (SLURM_TASK, (2, 2), 3),                                      # srun, one task per device
    ({**SLURM_TASK, "SLURM_JOB_NAME": "interactive"}, (1, 1), 0),  # Lightning's opt-out name
    ({**SLURM_TASK, "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "8", "RANK": "5"}, (2, 4), 5),
])
def test_world_shape_comes_from_the_launcher_that_started_the_process(
        variables, shape, rank, lightning_script, monkeypatch):
    """Under srun the Trainer's devices x num_nodes must equal SLURM_NTASKS, or Lightning
    refuses to start; torchrun under Slurm (the last case) wins over Slurm's task count."""
    for name in (*LAUNCHER_VARIABLES, *SLURM_TASK):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert lightning_script.world_from_launcher() == shape
    assert lightning_script.process_rank() == rank


@pytest.mark.parametrize("args, problem", [
    (["--lr", "0"], "--lr"),
    (["--corpus-tokens", "500"], "corpus has only"),
    (["--resume"], "--checkpoint-dir"),
    (["--strategy", "model-parallel", "--static-graph"], "only apply to --strategy ddp"),
    (["--strategy", "fsdp"], "requires a GPU accelerator"),
    (["--backend", "nccl"], "nccl"),
    (["--wait-for-signal-after-step", "0"], "--wait-for-signal-after-step"),
    (["--val-windows", "0"], "--val-windows"),
    (["--strategy", "model-parallel", "--val-windows", "4"], "only apply to --strategy ddp"),
])
def test_bad_input_gives_one_line_error(args, problem, lightning_script, monkeypatch, capsys):
    """Refused before any process group exists; FSDPStrategy's refusal is Lightning's own check."""
    if torch.cuda.is_available() and ("nccl" in args or "fsdp" in args):
        pytest.skip("this machine has GPUs, so the input is valid")
    code = run_in_process(LIGHTNING, "--model", "tiny", "--max-steps", "2", *args,
                          monkeypatch=monkeypatch)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert code == 2
    assert len(errors) == 1 and problem in errors[0], err
    assert "Traceback" not in err


def test_fabric_bad_input_gives_one_line_error(monkeypatch, capsys):
    code = run_in_process(FABRIC, "--model", "tiny", "--corpus-tokens", "500",
                          monkeypatch=monkeypatch)
    err = capsys.readouterr().err
    assert code == 2
    assert [line for line in err.splitlines() if "error:" in line] == [
        line for line in err.splitlines() if "corpus has only" in line]
    assert "Traceback" not in err


@pytest.mark.parametrize("script, flags", [
    (LIGHTNING, ["--model", "--epochs", "--max-steps", "--batch-size", "--accum-steps", "--lr",
                 "--seed", "--amp", "--bucket-cap-mb", "--backend", "--metrics",
                 "--checkpoint-dir", "--save-every", "--resume", "--crash-at-step", "--save-final",
                 "--strategy", "--sampler", "--grad-clip", "--static-graph", "--comm-hook",
                 "--wait-for-signal-after-step", "--val-windows"]),
    (FABRIC, ["--model", "--epochs", "--max-steps", "--batch-size", "--accum-steps", "--lr",
              "--seed", "--amp", "--bucket-cap-mb", "--backend", "--metrics", "--checkpoint-dir",
              "--resume", "--crash-at-step", "--save-final"]),
])
def test_help_lists_the_contract(script, flags, monkeypatch, capsys):
    assert run_in_process(script, "--help", monkeypatch=monkeypatch) == 0
    out = capsys.readouterr().out
    assert [flag for flag in flags if flag not in out] == []


def test_the_fabric_program_is_ch3_train_with_few_changes():
    """The chapter shows a diff; it stays small only if nothing else drifts between the files."""
    original = (SCRIPTS_DIR / "ch3_train.py").read_text().splitlines()
    converted = (SCRIPTS_DIR / FABRIC).read_text().splitlines()
    changed = [line for line in difflib.unified_diff(original, converted, lineterm="", n=0)
               if line[:1] in "+-" and line[:3] not in ("+++", "---")]
    # 47 lines change today, about a third of them in the docstring; ch3_train.py gaining a feature
    # that ch6_fabric.py lacks would show here first.
    assert len(changed) < 60, "\n".join(changed)

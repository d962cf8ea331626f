"""The GPU results: rendered from the H100's recorded files, and gpu_results.py's refusal without CUDA.

Nothing here needs a GPU; with one, the refusal is checked with the GPUs hidden. The every-script
stage's list is checked against the scripts themselves: it names every one, and each takes its
arguments, on a pretend GPU, as far as starting its process group.
"""

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from dtbook import gpu_report
from dtbook.cli import run_main
from dtbook.metrics import read_metrics
from support import LAUNCHER_VARIABLES, REPO, SCRIPTS, load_script, run_python

H100 = REPO / "notebooks" / "appendix" / "gpu_measurements" / "h100_2026-11-26"


@pytest.fixture(scope="module")
def h100():
    return gpu_report.load(H100)


def test_the_precision_table_is_the_probes_log_line_by_line(h100):
    rows = gpu_report.precision_table(h100).rows
    logged = [json.loads(line) for line in (H100 / "gpt_scale.log").read_text().splitlines()
              if line.startswith("{")]
    assert len(rows) == len(logged) == 8
    assert [r[2] for r in rows] == [r["mode"] for r in logged]
    assert [r[3] for r in rows] == [f"{r['step_ms']:.1f}" for r in logged]
    assert rows[-1][:6] == ["gpt2-small (124.5 M)", "16 × 1024", "bf16+compile", "35.9", "456,495", "39.7%"]


def test_the_same_rows_come_from_gpu_results_own_precision_file(h100, tmp_path):
    """gpu_results.py writes precision.jsonl; a folder with it renders as the probe's log does."""
    with open(tmp_path / "precision.jsonl", "w") as out:
        for record in gpu_report.probe_records(h100.logs["gpt_scale"]):
            out.write(json.dumps(record) + "\n")
    shutil.copy(H100 / "provenance.json", tmp_path)
    again = gpu_report.load(tmp_path)
    assert gpu_report.precision_table(again).rows == gpu_report.precision_table(h100).rows


def test_one_gpu_leaves_the_multi_gpu_tables_empty_and_says_why(h100):
    for table in gpu_report.SEVERAL_GPUS:
        assert table(h100).rows == [[gpu_report.NEEDS_TWO_GPUS] + [""] * (len(table(h100).header) - 1)]
    two = gpu_report.Measured(H100, {**h100.provenance, "gpu_count": 2}, h100.files, h100.logs)
    assert gpu_report.overlap_table(two).rows[0][0] == "not measured: its run failed"


def test_the_offload_row_of_a_run_without_host_counts_is_marked_not_measured(h100):
    table = gpu_report.footprint_table(h100)
    assert [r[0] for r in table.rows][-1] == "fsdp2_offload"
    assert "**not measured**" in table.note
    # The control: a run that recorded host memory apart shows it, and needs no such note.
    records = [dict(r) for r in h100.files["ch4_footprint"]]
    for r in records:
        if r["event"] == "footprint":
            offload = r["config"] == "fsdp2_offload"
            host = {"params": 482_304 * offload, "grads": 0, "optimizer": 964_608 * offload}
            r["ranks"] = [{**r["ranks"][0], "host": host}]
    split = gpu_report.Measured(H100, h100.provenance, {"ch4_footprint": records}, {})
    table = gpu_report.footprint_table(split)
    assert table.note == "" and table.rows[-1][-1] == "1.38 MiB"


def test_the_snapshot_summary_comes_from_the_logged_segsum(h100):
    rows = dict(gpu_report.snapshot_table(h100).rows)
    assert (rows["segments (segsum)"], rows["reserved (segsum)"]) == ("46", "206.0MiB")


def test_every_table_renders_under_the_runs_provenance(h100):
    page = gpu_report.render(h100)
    assert page.startswith("Measured on 1 × NVIDIA H100 80GB HBM3, driver 580.159.04, torch 2.11.0+cu130")
    assert page.count("**") // 2 >= len(gpu_report.ONE_GPU + gpu_report.SEVERAL_GPUS)


def test_the_script_renders_a_recorded_folder_without_a_gpu(tmp_path):
    folder = tmp_path / "h100"
    shutil.copytree(H100, folder)
    done = run_python("gpu_results.py", "--render", folder, env={"CUDA_VISIBLE_DEVICES": ""}, timeout=120)
    assert (folder / "tables.md").read_text() == gpu_report.render(gpu_report.load(H100))
    assert "| gpt2-small (124.5 M) | 16 × 1024 | bf16+compile | 35.9 |" in done.output


def test_the_script_refuses_a_machine_without_cuda_in_one_line():
    done = run_python("gpu_results.py", env={"CUDA_VISIBLE_DEVICES": ""}, check=False, timeout=120)
    assert done.returncode == 2
    assert done.output.strip().splitlines() == [done.output.strip()]  # one line
    assert done.output.startswith("error: no CUDA GPU here")


def test_a_snapshot_summary_recorded_in_the_metrics_is_preferred_to_the_log(h100):
    event = {"event": "cuda_snapshot", "allocated": [1 << 20, 3 << 20], "segments": 2,
             "reserved_bytes": 4 << 20, "allocated_bytes": 3 << 20, "free_bytes": 1 << 20}
    run = gpu_report.Measured(H100, h100.provenance, {"ch1_memory": [event]}, h100.logs)
    rows = dict(gpu_report.snapshot_table(run).rows)
    assert rows["segments (allocator segments)"] == "2"
    assert rows["free (allocator segments)"] == "1.00 MiB"
    assert rows["peak allocated during the step (memory_viz curve)"] == "3.00 MiB"
    assert "segments (segsum)" not in rows


def test_the_gpu_scripts_plan_mfu_peaks_and_launch_lines():
    script = load_script("gpu_results.py")
    assert script.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert script.peak_flops("NVIDIA H100 PCIe") == 756e12  # not the SXM part's peak
    assert script.peak_flops("Tesla T4") is None  # no peak known: MFU left out, not guessed
    plan = {name: processes for name, _, processes, _ in script.one_gpu_runs(H100, 1)}
    assert plan["ch1_memory"] == 0 and plan["ch4_footprint"] == 1  # python, torchrun on 1 GPU
    several = script.several_gpu_runs(4)
    assert {name for name, *_ in several} == {"ch2_bandwidth", "ch3_overlap", "ch4_fsdp_multi"}
    assert all(processes == 4 and "nccl" in args for _, args, processes, _ in several)
    line = script.command(["ch3_train.py", "--max-steps", 40], 2, H100 / "m.jsonl")
    assert line[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    assert line[-4:] == ["--max-steps", "40", "--metrics", str(H100 / "m.jsonl")]


@pytest.fixture
def pretend_h100(monkeypatch):
    """gpu_results.py on pretend CUDA: each run 'writes' the H100's recorded file of its name."""
    script = load_script("gpu_results.py")
    cuda = script.torch.cuda
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "device_count", lambda: 1)
    monkeypatch.setattr(cuda, "get_device_name", lambda *_: "NVIDIA H100 80GB HBM3")
    probe = {(r["model"], r["mode"]): r for r in gpu_report.probe_records((H100 / "gpt_scale.log").read_text())}
    monkeypatch.setattr(script, "precision_step", lambda size, batch, mode: {
        k: v for k, v in probe[size, mode].items() if k != "event"})

    def replay(argv, cap_s, log, env=None):
        metrics = Path(argv[argv.index("--metrics") + 1])
        recorded = H100 / metrics.name
        if recorded.exists() and metrics.parent.name != "every_script":  # not the stage's runs
            shutil.copy(recorded, metrics)
        return 0, 1.0

    monkeypatch.setattr(script, "run_capped", replay)
    return script


def test_a_run_writes_a_folder_that_renders_as_the_recorded_one(pretend_h100, tmp_path, monkeypatch):
    out = tmp_path / "run"
    monkeypatch.setattr(sys, "argv", ["gpu_results.py", "--out", str(out)])
    pretend_h100.main()
    provenance = json.loads((out / "provenance.json").read_text())
    assert (provenance["gpu"], provenance["gpu_count"]) == ("NVIDIA H100 80GB HBM3", 1)
    assert {"driver", "torch", "date", "commit"} <= provenance.keys()
    runs = [r for r in read_metrics(out / "runs.jsonl") if r["event"] == "run"]
    assert [r["status"] for r in runs] == [0] * 9  # one GPU: no multi-GPU runs planned
    made, recorded = gpu_report.load(out), gpu_report.load(H100)
    for table in gpu_report.ONE_GPU:
        if table is not gpu_report.snapshot_table:  # its totals were in the old run's log only
            assert table(made).rows == table(recorded).rows, table.__name__
    assert gpu_report.snapshot_table(made).rows[0] == gpu_report.snapshot_table(recorded).rows[0]
    assert (out / "tables.md").read_text() == gpu_report.render(made)


def test_a_spent_budget_skips_runs_and_says_so(pretend_h100, tmp_path, monkeypatch):
    clock = iter(range(0, 10**6, 100))  # every look at the clock: 100 s later
    monkeypatch.setattr(pretend_h100.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(sys, "argv", ["gpu_results.py", "--out", str(tmp_path / "run"), "--budget-s", "450",
                                      "--scripts-budget-s", "60"])
    pretend_h100.main()
    statuses = [r["status"] for r in read_metrics(tmp_path / "run" / "runs.jsonl")]
    skipped = [r for r in read_metrics(tmp_path / "run" / "precision.jsonl") if "error" in r]
    assert "skipped: budget spent" in statuses and skipped
    rendered = gpu_report.precision_table(gpu_report.load(tmp_path / "run")).rows
    assert rendered[-1][3] == "skipped: budget spent"
    stage = [r["status"] for r in read_metrics(tmp_path / "run" / "runs.jsonl") if r["event"] == "script"]
    assert stage.count("skipped: budget spent") == len(stage) - 3  # and 3 skipped for their world


def test_the_every_script_stage_records_and_renders_ok_failed_and_skipped(pretend_h100, tmp_path, monkeypatch):
    """Each script once, the longest first: ok, failed with the line that says why, skipped with why."""
    envs = {}

    def run(argv, cap_s, log, env=None):
        script = next(Path(a).name for a in argv if a.endswith(".py") and "/scripts/ch" in a)
        envs[script] = env
        if script == "ch1_attention.py":
            log.write_text("Traceback (most recent call last):\n  File ...\nRuntimeError: CUDA error: "
                           "no kernel image | is available\n")
            return 1, 2.5
        if script == "ch6_lightning.py":  # torchrun's summary follows the worker's error
            log.write_text("[rank0]: ValueError: bad | thing\n" + "=" * 40 + "\n"
                           "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
                           "  error_file: <N/A>\n" + "-" * 40 + "\n")
            return 1, 3.0
        if script == "ch3_compile_ddp.py":
            log.write_text("compiling ...\n")
            return f"killed after {cap_s} s", cap_s
        return 0, 1.0

    monkeypatch.setattr(pretend_h100, "run_capped", run)
    out = tmp_path / "run"
    monkeypatch.setattr(sys, "argv", ["gpu_results.py", "--out", str(out), "--jobs", "2"])
    pretend_h100.main()
    records = [r for r in read_metrics(out / "runs.jsonl") if r["event"] == "script"]
    listed = pretend_h100.every_script_runs(tmp_path)
    assert [r["script"] for r in records] == [run.script for run in sorted(listed, key=lambda r: -r.cap_s)]
    assert [r["script"] for r in records][:2] == ["ch3_compile_ddp.py", "ch7_compile_benchmark.py"]
    assert envs["ch3_hang_forensics.py"]["TORCH_FR_BUFFER_SIZE"] == "2000"
    assert {env["OMP_NUM_THREADS"] for env in envs.values()} == {str(max(1, (os.cpu_count() or 1) // 2))}
    assert len(envs) == len(listed) - 3  # the 3 skipped for their world never start
    table = gpu_report.scripts_table(gpu_report.load(out))
    assert [row[0] for row in table.rows] == sorted(run.script for run in listed)  # by name
    rows = {row[0]: row for row in table.rows}
    assert rows["ch1_attention.py"][1:] == ["python (a world of one)",
                                            "failed (exit 1): RuntimeError: CUDA error: no kernel image | is available",
                                            "2.5"]
    assert rows["ch6_lightning.py"][2] == "failed (exit 1): [rank0]: ValueError: bad | thing"
    assert rows["ch3_compile_ddp.py"][2] == "failed (killed after 150 s): compiling ..."
    assert rows["ch7_stragglers.py"][1:3] == ["not run", "skipped: needs 2 or more processes: a straggler is "
                                                         "one rank among others"]
    assert rows["ch3_train.py"][2] == "ok"
    assert gpu_report.scripts_table(gpu_report.load(out)).note.startswith(
        f"{len(listed) - 6} ok, 3 failed, 3 skipped, of {len(listed)} scripts; up to 2 ran at a time")
    tables = (out / "tables.md").read_text()
    assert "| ch1_attention.py | python (a world of one) | failed (exit 1): RuntimeError: CUDA error: " \
           "no kernel image \\| is available | 2.5 |" in tables  # the | escaped: one row, four cells


def test_a_folder_made_before_the_stage_says_its_scripts_were_not_run(h100):
    assert gpu_report.scripts_table(h100).rows == [[gpu_report.NO_SCRIPT_RUNS, "", "", ""]]


def test_a_console_line_with_a_bar_stays_in_its_cell():
    table = gpu_report.Table("t", ["script", "result"], [["a.py", "failed (exit 1): x | y"]])
    assert table.markdown().splitlines()[-1] == "| a.py | failed (exit 1): x \\| y |"


def test_the_every_script_stage_lists_every_companion_script(tmp_path):
    """Complete by construction: a new scripts/ch*.py that the list lacks fails here."""
    runs = load_script("gpu_results.py").every_script_runs(tmp_path)
    listed = [run.script for run in runs]
    assert len(listed) == len(set(listed)), "a script is listed twice"
    scripts = sorted(p.name for p in SCRIPTS.glob("ch*.py"))
    assert sorted(set(scripts) - set(listed)) == [], "give each a line in gpu_results.every_script_runs"
    assert sorted(listed) == scripts
    for run in runs:
        assert run.processes in (0, 1) and 0 < run.cap_s <= 150, run
        assert not (run.skip and (run.args or run.env)), f"{run.script}: skipped, but given arguments"


def test_the_stage_runs_each_script_on_one_process_with_nccl(tmp_path):
    script = load_script("gpu_results.py")
    commands = {run.script: script.script_command(run, tmp_path / "m.jsonl")
                for run in script.every_script_runs(tmp_path) if not run.skip}
    for name, argv in commands.items():
        assert argv[argv.index(str(SCRIPTS / name)) + 1:][-4:] == ["--backend", "nccl", "--metrics",
                                                                   str(tmp_path / "m.jsonl")]
    assert commands["ch3_train.py"][1] == str(SCRIPTS / "ch3_train.py")  # python: a world of one
    assert commands["ch6_lightning.py"][1:5] == ["-m", "torch.distributed.run", "--standalone",
                                                 "--nproc_per_node=1"]


class Started(BaseException):
    """The script got as far as starting its process group or its processes, asking for ``asked``.

    A BaseException, so that no ``except Exception`` of a script turns it into a failure.
    """

    def __init__(self, asked: str):
        self.asked = asked


def started(*args, **kwargs):
    raise Started(repr((args, kwargs)))


@pytest.fixture
def one_pretend_gpu(monkeypatch):
    """One CUDA GPU as far as choose_backend can tell; what would start processes stops instead."""
    import lightning
    import torch
    import torch.multiprocessing

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.distributed, "init_process_group", started)
    monkeypatch.setattr(torch.multiprocessing, "spawn", started)
    monkeypatch.setattr(lightning, "Trainer", started)
    for name in LAUNCHER_VARIABLES:  # a world of one
        monkeypatch.delenv(name, raising=False)


def start(script, run, tmp_path, monkeypatch):
    """Run ``run``'s command line through the script's ``main`` in this process until it starts.

    Every variable the script sets meanwhile (the launcher's for a world of one, MKL_CBWR,
    inductor's cache) is gone afterwards, so that the next script starts from the same place.
    """
    module = load_script(run.script)
    for name in ("launch_torchrun", "Fabric"):  # imported by name: ch3_repeatability, ch6_fabric
        if hasattr(module, name):
            monkeypatch.setattr(module, name, started)
    argv = script.script_command(run, tmp_path / "metrics.jsonl")
    monkeypatch.setattr(sys, "argv", argv[argv.index(str(SCRIPTS / run.script)):])
    environ = dict(os.environ)
    if run.processes:  # what torchrun --standalone --nproc_per_node=1 gives its worker
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    os.environ.update(run.env)
    try:
        run_main(module.main)
    except Started as begun:
        # On the GPU: the group's backend, the workers' or the runs' --backend, the accelerator
        return "started" if "'nccl'" in begun.asked or "'cuda'" in begun.asked else begun.asked
    except SystemExit as exit_:
        return exit_.code
    finally:
        os.environ.clear()
        os.environ.update(environ)
    return "returned without starting"


def test_every_listed_command_line_gets_as_far_as_the_process_group(one_pretend_gpu, tmp_path, monkeypatch,
                                                                      capsys):
    """Each script's parser and its checks before init_process_group accept the stage's arguments.

    On a pretend GPU, so that --backend nccl passes choose_backend; every check a script makes
    before its group (argparse, check_inputs, main's own) runs, and the group is never started.
    """
    script = load_script("gpu_results.py")
    runs = script.every_script_runs(tmp_path)
    refused = {}
    for run in runs:
        if not run.skip:
            result = start(script, run, tmp_path, monkeypatch)
            if result != "started":
                refused[run.script] = (result, capsys.readouterr().err.strip()[-300:])
    assert refused == {}
    # The control: a world of one is refused, in one line, by each script skipped for it.
    for run in runs:
        if run.skip:
            assert start(script, run, tmp_path, monkeypatch) == 2, run.script
            assert capsys.readouterr().err.startswith("error: "), run.script
    assert sum(bool(run.skip) for run in runs) == 3

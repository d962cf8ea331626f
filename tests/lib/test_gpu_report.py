"""The GPU results: rendered from the H100's recorded files, and gpu_results.py's refusal without CUDA.

Nothing here needs a GPU; with one, the refusal is checked with the GPUs hidden.
"""

import json
import shutil

import pytest

from dtbook import gpu_report
from support import REPO, load_script, run_python

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

"""The book's GPU results as tables, read from one measured run's files (no torch).

A measured run is a folder: ``provenance.json`` (GPU, driver, torch, date, commit) and the
``--metrics`` files of the companion scripts, named as ``scripts/gpu_results.py`` names them.
The appendix and ``gpu_results.py`` render with the same functions, so every number on the
page comes from a file a GPU wrote. A file that is absent gives a row saying what was not
measured and why; nothing is estimated.
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass, field
from html import escape
from pathlib import Path

from dtbook.exposed import describe
from dtbook.metrics import read_metrics

NEEDS_TWO_GPUS = "not measured: needs ≥ 2 GPUs"
NO_SCRIPT_RUNS = "not run: runs.jsonl records no companion script (the every-script stage did not exist then)"
# The precision table's modes, in the order a reader turns them on.
MODES = ["fp32", "tf32", "bf16", "bf16+compile"]
# gpu_scale_probe.py's headings in its log, as the model sizes of dtbook.model.
PROBE_MODELS = {"book large": "large", "gpt2-small shape": "gpt2-small"}


@dataclass
class Table:
    title: str
    header: list[str]
    rows: list[list[str]] = field(default_factory=list)
    note: str = ""

    def html(self) -> str:
        """The table as HTML, which a notebook's output shows as a table in the built book."""
        def cells(tag, values):
            return "<tr>" + "".join(f"<{tag}>{escape(v)}</{tag}>" for v in values) + "</tr>"
        body = "".join(cells("td", row) for row in self.rows)
        note = f"<p><em>{escape(self.note.replace('**', ''))}</em></p>" if self.note else ""
        return (f"<p><strong>{escape(self.title)}</strong></p><table><thead>"
                f"{cells('th', self.header)}</thead><tbody>{body}</tbody></table>{note}")

    def measured(self) -> bool:
        return bool(self.rows) and not self.rows[0][0].startswith("not measured")

    def markdown(self) -> str:
        lines = [f"**{self.title}**", "", "| " + " | ".join(self.header) + " |",
                 "|" + "---|" * len(self.header)]
        # A cell may quote a console line: its "|" would end the cell.
        lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in self.rows]
        return "\n".join(lines + ([""] + [self.note] if self.note else []))


@dataclass
class Measured:
    """One measured run's folder, read."""

    folder: Path
    provenance: dict
    files: dict[str, list[dict]]
    logs: dict[str, str]

    def records(self, name: str, event: str) -> list[dict]:
        return [r for r in self.files.get(name, []) if r.get("event") == event]

    def describe(self) -> str:
        p = self.provenance
        gpus = f"{p['gpu_count']} × {p['gpu']}"
        return (f"{gpus}, driver {p['driver']}, torch {p['torch']}, measured {p['date']} "
                f"at commit {p['commit']}")


def load(folder: str | Path) -> Measured:
    folder = Path(folder)
    provenance = json.loads((folder / "provenance.json").read_text())
    files = {p.stem: read_metrics(p) for p in sorted(folder.glob("*.jsonl"))}
    logs = {p.stem: p.read_text() for p in sorted(folder.glob("*.log"))}
    return Measured(folder, provenance, files, logs)


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.2f} MiB"


# ---------------------------------------------------------------- one GPU


def probe_records(log: str) -> list[dict]:
    """The JSON lines of gpu_scale_probe.py's log, each with the model size it measured."""
    records, model = [], None
    for line in log.splitlines():
        if line.startswith("== "):
            model = PROBE_MODELS[line[3:].strip()]
        elif line.startswith("{"):
            records.append({"event": "precision", "model": model, **json.loads(line)})
    return records


def precision_records(run: Measured) -> list[dict]:
    """gpu_results.py's precision.jsonl, or the probe's log of a run made before it existed."""
    if "precision" in run.files:
        return run.records("precision", "precision")
    return probe_records(run.logs.get("gpt_scale", ""))


def precision_table(run: Measured) -> Table:
    table = Table("fp32, TF32, bf16 and torch.compile: one training step (AdamW)",
                  ["model", "batch × context", "mode", "ms/step", "tokens/s", "MFU", "peak memory"])
    for r in precision_records(run):
        size = f"{r['model']} ({r['params'] / 1e6:.1f} M)" if "params" in r else r["model"]
        if "error" in r:  # out of memory, or skipped when the time budget was spent
            table.rows.append([size, "", r["mode"], r["error"][:60], "", "", ""])
            continue
        table.rows.append([size, f"{r['batch']} × {r['ctx']}", r["mode"], f"{r['step_ms']:.1f}",
                           f"{r['tokens_per_s']:,}", f"{r['mfu_bf16_peak']:.1%}",
                           f"{r['peak_mem_gib']:.2f} GiB"])
    table.note = ("MFU: 6·N + 12·L·d·T FLOPs per token against the GPU's dense bf16 peak, for every "
                  "mode (fp32 included), so the column compares the modes with each other.")
    return table


def sdpa_table(run: Measured) -> Table:
    table = Table("scaled_dot_product_attention's kernels, each forced with sdpa_kernel",
                  ["dtype", "backend", "result", "SDPA's own choice"])
    for r in run.records("ch1_attention", "backend"):
        chosen = ", ".join(k.removeprefix("_scaled_dot_product_") for k in r["default_kernel"])
        table.rows.append([r["dtype"], r["backend"], "works" if r["works"] else r["problem"], chosen])
    return table


def attention_sweep_table(run: Measured) -> Table:
    table = Table("attention of the medium model, forward and backward",
                  ["sequence", "implementation", "saved for backward", "ms"])
    for r in run.records("ch1_attention", "sweep"):
        table.rows.append([str(r["seq_len"]), r["implementation"], mib(r["saved_bytes"]), f"{r['ms']:.2f}"])
    return table


def snapshot_table(run: Measured) -> Table:
    """The allocator's segments after one fp32 step: from the event, or segsum's lines in the log."""
    table = Table("the CUDA caching allocator after one fp32 step (small model)", ["quantity", "value"])
    (event,) = run.records("ch1_memory", "cuda_snapshot") or [{}]
    curve = event.get("allocated", [])
    if curve:
        table.rows.append(["peak allocated during the step (memory_viz curve)", mib(max(curve))])
    if "segments" in event:  # ch1_memory.py's segment_totals: blocks at their rounded sizes
        source = "allocator segments"
        summary = {"segments": str(event["segments"])}
        summary |= {k: mib(event[f"{k}_bytes"]) for k in ("reserved", "allocated", "free")}
    else:  # older runs: segsum's lines in the console log
        source = "segsum"
        found = re.findall(r"^(segments|total_reserved|total_allocated|total_free): (.+)$",
                           run.logs.get("book_scripts", ""), re.M)
        summary = {k.removeprefix("total_"): v for k, v in found}
    for key in ("segments", "reserved", "allocated", "free"):
        if key in summary:
            table.rows.append([f"{key} ({source})", summary[key]])
    return table


def memory_table(run: Measured) -> Table:
    table = Table("one training step's memory, counted tensor by tensor and by the allocator",
                  ["model", "precision", "parameters", "activations", "optimizer state",
                   "max_memory_allocated"])
    for r in run.records("ch1_memory", "step_memory"):
        table.rows.append([r["model"], r["precision"], mib(r["parameters"]), mib(r["activations"]),
                           mib(r["optimizer_state"]), mib(r["cuda_max_allocated"])])
    return table


def footprint_table(run: Measured) -> Table:
    table = Table("DDP, ZeRO-1 and FSDP2 on the device, per rank (small model)",
                  ["configuration", "parameters", "gradients", "optimizer", "peak in the step",
                   "in host memory"])
    split = False
    for r in run.records("ch4_footprint", "footprint"):
        me = r["ranks"][0]
        host = me.get("host")
        split |= "host" in me
        on_host = "-" if not host else mib(host["params"] + host["grads"] + host["optimizer"])
        table.rows.append([r["config"], mib(me["params"]), mib(me["grads"]), mib(me["optimizer"]),
                           mib(me["peak_step"]), on_host if "host" in me else "not recorded"])
    if table.rows and not split:
        table.note = ("Recorded before ch4_footprint.py told device from host memory: these "
                      "counts include the host's, so fsdp2_offload's row repeats fsdp2_full's. "
                      "fsdp2_offload's device memory is **not measured** in this run.")
    return table


def training_table(run: Measured) -> Table:
    """The mixed-precision training runs of chapters 1, 3 and 4 on the GPU."""
    table = Table("mixed precision in training, a world of one on the GPU",
                  ["run", "steps", "first loss", "final loss", "speed"])
    for r in run.records("ch1_precision", "curve"):
        losses = r["losses"]
        table.rows.append([f"ch1_precision.py {r['precision']}", str(len(losses)),
                           f"{losses[0]:.4f}", f"{losses[-1]:.4f}", f"median step {r['step_ms']:.1f} ms"])
    runs = {"ch3_bf16": "ch3_train.py --amp bf16", "ch3_fp16": "ch3_train.py --amp fp16",
            "ch4_fsdp": "ch4_fsdp.py --mixed-precision bf16"}
    for name, label in runs.items():
        for r in run.records(name, "summary"):
            table.rows.append([label, str(r["steps"]), f"{r['first_loss']:.4f}", f"{r['final_loss']:.4f}",
                               f"{r['samples_per_s']:,.0f} samples/s, first steps included"])
    return table


def compile_table(run: Measured) -> Table:
    (setup,) = run.records("ch7_compile", "setup") or [{"model": "?", "compiler": "?"}]
    table = Table(f"torch.compile ({setup['compiler']}) of the {setup['model']} model, one GPU",
                  ["variant", "first step", "median steady step", "min", "max"])
    for r in run.records("ch7_compile", "variant"):
        ms = r["step_ms"]
        # median_high: the middle step as the script prints it, not a mean of two steps
        table.rows.append([r["variant"], f"{r['first_step_s']:.2f} s", f"{statistics.median_high(ms):.2f} ms",
                           f"{min(ms):.2f} ms", f"{max(ms):.2f} ms"])
    return table


def lightning_table(run: Measured) -> Table:
    table = Table("Lightning's Trainer on one GPU", ["strategy", "backend", "precision", "processes",
                                                    "steps", "final loss", "samples/s"])
    setups, summaries = run.records("ch6_lightning", "lightning_setup"), run.records("ch6_lightning", "summary")
    for s, r in zip(setups, summaries, strict=False):
        table.rows.append([s["strategy"], s["process_group_backend"], s["precision"], str(s["world_size"]),
                           str(r["steps"]), f"{r['final_loss']:.4f}", f"{r['samples_per_s']:,.0f}"])
    return table


# ---------------------------------------------------------------- several GPUs


def bandwidth_table(run: Measured) -> Table:
    table = Table("NCCL: bus bandwidth and the α–β fit to all_reduce",
                  ["collective", "GPUs", "largest message", "busbw", "α", "1/β"])
    rows = run.records("ch2_bandwidth", "collective")
    (fit,) = run.records("ch2_bandwidth", "fit") or [None]
    for name in dict.fromkeys(r["collective"] for r in rows):
        largest = max((r for r in rows if r["collective"] == name), key=lambda r: r["nbytes"])
        alpha, beta = ("", "")
        if fit and name in fit["collectives"]:
            alpha, beta = f"{fit['alpha_s'] * 1e6:.1f} µs", f"{1 / fit['beta_s_per_byte'] / 1e9:.1f} GB/s"
        table.rows.append([name, str(largest["world_size"]), mib(largest["nbytes"]),
                           f"{largest['busbw_GBps']:.1f} GB/s", alpha, beta])
    return not_measured_if_empty(table, run)


def overlap_table(run: Measured) -> Table:
    table = Table("DDP: how much of the all-reduce the backward pass hides",
                  ["model", "bucket_cap_mb", "buckets", "T_ddp", "T_local", "T_comm",
                   "exposed waited/T_comm (95%), or why none"])
    for r in run.records("ch3_overlap", "overlap"):
        cap = "default" if r["bucket_cap_mb"] is None else f"{r['bucket_cap_mb']:g}"
        table.rows.append([r["model"], cap, str(r["buckets"]), f"{r['t_ddp_ms']:.2f} ms",
                           f"{r['t_local_ms']:.2f} ms", f"{r['t_comm_ms']:.2f} ms",
                           # on CUDA the script refuses it: its host clock does not
                           # see NCCL's wait (dtbook.exposed), and the reason says so
                           describe(r["exposed"])])
    return not_measured_if_empty(table, run)


def fsdp_table(run: Measured) -> Table:
    table = Table("FSDP2 across GPUs, bf16 mixed precision", ["processes", "steps", "final loss",
                                                              "step time", "peak memory"])
    for r in run.records("ch4_fsdp_multi", "summary"):
        world = run.records("ch4_fsdp_multi", "provenance")[0]["world_size"]
        table.rows.append([str(world), str(r["steps"]), f"{r['final_loss']:.4f}",
                           f"{r['step_time_s'] * 1e3:.1f} ms", mib(r["peak_memory_bytes"])])
    return not_measured_if_empty(table, run)


def not_measured_if_empty(table: Table, run: Measured) -> Table:
    if not table.rows:
        why = NEEDS_TWO_GPUS if run.provenance["gpu_count"] < 2 else "not measured: its run failed"
        table.rows.append([why] + [""] * (len(table.header) - 1))
    return table


def runs_table(run: Measured) -> Table:
    """Every command of the run and how it ended: runs.jsonl, or the older console log's lines."""
    table = Table("the runs", ["run", "exit status", "seconds"])
    for r in run.records("runs", "run"):
        table.rows.append([r["name"], str(r["status"]), f"{r['seconds']:.1f}"])
    if not table.rows:
        for name, status, seconds in re.findall(r"^=== (\S+) rc=(\d+) ([\d.]+)s$",
                                                run.logs.get("book_scripts", ""), re.M):
            if name != "env":
                table.rows.append([name, status, seconds])
    return table


def script_result(record: dict) -> str:
    """ok, failed (how: its last line) or skipped: why, for one run of the every-script stage."""
    status = record["status"]
    if status == 0:
        return "ok"
    if isinstance(status, str) and status.startswith("skipped"):
        return status
    how = f"exit {status}" if isinstance(status, int) else status
    return f"failed ({how}): {record['last_line']}" if record["last_line"] else f"failed ({how})"


def scripts_table(run: Measured) -> Table:
    """Every companion script's CUDA path, one process each: gpu_results.py's every-script stage."""
    table = Table("every script's CUDA path: one process each, --backend nccl",
                  ["script", "run as", "result", "seconds"])
    records = sorted(run.records("runs", "script"), key=lambda r: r["script"])
    for r in records:
        table.rows.append([r["script"], r["how"], script_result(r), f"{r['seconds']:.1f}"])
    if not records:
        table.rows.append([NO_SCRIPT_RUNS, "", "", ""])
        return table
    results = [script_result(r).split(" ")[0].rstrip(":") for r in records]
    table.note = (f"{results.count('ok')} ok, {results.count('failed')} failed, "
                  f"{results.count('skipped')} skipped, of {len(records)} scripts; up to "
                  f"{records[0]['jobs']} ran at a time, sharing the GPU and the cores.")
    return table


def coverage(run: Measured) -> Table:
    """Which tables this run filled, and why the others are empty."""
    table = Table(f"what {run.folder.name} measured", ["table", "status"])
    for make in ONE_GPU + SEVERAL_GPUS:
        made = make(run)
        status = "measured" if made.measured() else made.rows[0][0] if made.rows else "no data"
        if "**not measured**" in made.note:
            status = "partly: " + made.note.split(". ")[-1].replace("**", "")
        table.rows.append([made.title, status])
    return table


ONE_GPU = [precision_table, sdpa_table, attention_sweep_table, memory_table, snapshot_table,
           footprint_table, training_table, compile_table, lightning_table]
SEVERAL_GPUS = [bandwidth_table, overlap_table, fsdp_table]


def render(run: Measured) -> str:
    """Every table of one measured run, in markdown, under its provenance."""
    parts = [f"Measured on {run.describe()}."]
    parts += [table(run).markdown() for table in ONE_GPU + SEVERAL_GPUS + [scripts_table]]
    return "\n\n".join(parts) + "\n"

"""Chapter 2, sections 2-5: what the notebooks do not run themselves.

The notebooks (executed by the quick book build) assert the chapter's claims on 2 and 4 processes.
Here: the ring on an odd number of processes, the benchmark's printed table against its metrics and
its saved model, and the one-line refusals of inputs that cannot work, checked in-process.
"""

import re
import sys

import pytest

from dtbook.cli import ScriptError, byte_size, format_bytes
from dtbook.cost_model import AlphaBeta, Measurement
from dtbook.metrics import read_metrics
from support import load_script, run_torchrun


def test_ring_on_three_processes_is_exact_and_sends_the_formula_bytes(tmp_path):
    """Three ranks: unequal chunks for most lengths, and a world that is not a power of two."""
    metrics = tmp_path / "m.jsonl"
    lengths = [2, 3, 4099, 12288]
    run_torchrun("ch2_ring_all_reduce.py", "--algorithms", "ring", "--sizes", "--check-elements", *lengths,
                 "--metrics", metrics, nproc=3, timeout=240)
    checks = [r for r in read_metrics(metrics) if r["event"] == "check"]
    assert [c["elements"] for c in checks] == lengths
    for c in checks:
        n, sent = c["elements"], c["integers"]["sent"]
        assert c["integers"]["bitwise_equal"] and c["integers"]["same_on_all_ranks"]
        assert c["floats"]["rounding_units"] <= c["floats"]["bound_units"] == 4
        assert c["floats"]["control_rounding_units"] > 1000 * c["floats"]["bound_units"]
        assert sum(sent) == 2 * 2 * 4 * n, "each chunk crosses N-1 = 2 links in each phase"
        if n % 3 == 0:
            assert sent == [4 / 3 * 4 * n] * 3, "2(N-1)/N of the tensor from every rank"
        else:
            assert len(set(sent)) > 1, "unequal chunks: the ranks send different amounts"


def test_benchmark_prints_a_table_that_matches_its_metrics_and_saves_its_model(tmp_path):
    metrics, model_file = tmp_path / "m.jsonl", tmp_path / "model.json"
    done = run_torchrun("ch2_bandwidth.py", "--max-bytes", "64KiB", "--step", 16, "--rounds", 1,
                        "--round-seconds", 0.001, "--model-out", model_file,
                        "--metrics", metrics, nproc=2, timeout=240)
    records = read_metrics(metrics)
    rows = [r for r in records if r["event"] == "collective"]
    (fit,) = [r for r in records if r["event"] == "fit"]
    assert {r["collective"] for r in rows} == {"all_reduce", "all_gather", "reduce_scatter", "broadcast"}
    assert sorted({r["nbytes"] for r in rows}) == [8, 64, 1024, 16384]  # 4 B rounds up to 2 floats
    assert fit["collectives"] == ["all_reduce"], "DDP's collective, by default"
    fitted = AlphaBeta(fit["alpha_s"], fit["beta_s_per_byte"])
    all_reduces = [measured(r) for r in rows if r["collective"] == "all_reduce"]
    assert fit["relative_errors"] == pytest.approx(fitted.relative_errors(all_reduces))

    model = AlphaBeta.load(model_file)
    assert (model.alpha_s, model.beta_s_per_byte) == (fit["alpha_s"], fit["beta_s_per_byte"])
    # One row per size, the collectives side by side in the header's order: time, busbw.
    header = next(line for line in done.output.splitlines() if "all_reduce" in line)
    order = header.split()
    assert sorted(order) == sorted({r["collective"] for r in rows})
    by_key = {(r["collective"], r["nbytes"]): r for r in rows}
    copies = {r["nbytes"]: r for r in records if r["event"] == "copy"}
    assert sorted(copies) == sorted({r["nbytes"] for r in rows}), "the copy rate at every size"
    for size in sorted({r["nbytes"] for r in rows}):
        line = re.search(rf"^ *{re.escape(format_bytes(size))}((?: +[-\d.]+)+)  copy_ ([\d.]+) GB/s$",
                         done.output, re.M)
        assert line, f"no table row for {format_bytes(size)}:\n{done.output}"
        values = [float(v) for v in line.group(1).split()]
        for i, collective in enumerate(order):
            r = by_key[collective, size]
            assert values[2 * i] == pytest.approx(r["seconds"] * 1e6, abs=0.051)  # to 0.1 us
            assert values[2 * i + 1] == pytest.approx(r["busbw_GBps"], abs=0.00051)
        assert float(line.group(2)) == pytest.approx(copies[size]["GBps"], abs=0.0051)
    largest = max(r["nbytes"] for r in rows)
    for collective in order:
        predicted = model.predict(largest, 2, collective) * 1e6
        printed = re.search(rf"{collective} (\d+) us", done.output.split("the model at")[1])
        assert float(printed.group(1)) == pytest.approx(predicted, abs=0.51)  # to 1 us
    assert "memory copy:" in done.output and "alpha-beta fit to all_reduce:" in done.output
    (clone,) = [r for r in records if r["event"] == "clone"]
    assert clone["nbytes"] == largest and len(clone["round_seconds"]) == 1  # --rounds 1
    assert len(clone["copy_round_seconds"]) == 1, "copy_ in the same, alternating rounds"
    (drift,) = [r for r in records if r["event"] == "drift"]
    assert drift["nbytes"] == largest and len(drift["before_round_seconds"]) == 3  # at least 3
    assert f"clone: {clone['seconds'] * 1e3:.2f} ms" in done.output
    (faults,) = [r for r in records if r["event"] == "page_faults"]
    assert set(faults["per_call"]) == set(order) | {"clone", "reduce_scatter (list)"}
    assert f"minor page faults per call at {format_bytes(largest)}" in done.output


def measured(row: dict) -> Measurement:
    return Measurement(row["collective"], row["world_size"], row["nbytes"], row["seconds"])


TORCHRUN_ENV = {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400"}


@pytest.mark.parametrize("script, argv, env, message", [
    ("ch2_ring_all_reduce.py", [], {"WORLD_SIZE": "3"}, "a power-of-two number of processes is needed"),
    ("ch2_collectives.py", [], {"WORLD_SIZE": "1"}, "at least 2 processes"),
    ("ch2_process_groups.py", [], {"WORLD_SIZE": "1"}, "2 or more processes"),
    ("ch2_process_groups.py", ["--init-method", "udp://x"], {"WORLD_SIZE": "2"}, "use env://, tcp://"),
    ("ch2_process_groups.py", ["--init-method", "tcp://127.0.0.1:29999"], {"WORLD_SIZE": "2", **TORCHRUN_ENV},
     "nobody would serve this port"),
    ("ch2_process_groups.py", ["--init-method", "tcp://127.0.0.1"], {"WORLD_SIZE": "2"}, "with a port number"),
    ("ch2_process_groups.py", ["--late-rank", "0"], {"WORLD_SIZE": "2"}, "--late-rank must be between 1 and 1"),
    ("ch2_process_groups.py", ["--late-rank", "1", "--timeout-s", "5", "--late-by-s", "5"], {"WORLD_SIZE": "2"},
     "must exceed --timeout-s"),
    ("ch2_bandwidth.py", ["--min-bytes", "1MiB", "--max-bytes", "1KiB"], {}, "larger than --max-bytes"),
    ("ch2_bandwidth.py", ["--step", "1"], {}, "--step must be at least 2"),
    ("ch2_bandwidth.py", ["--collectives", "broadcast", "--fit-collectives", "all_reduce"], {},
     "fit only what --collectives measures"),
])
def test_impossible_requests_are_refused_before_any_process_group_exists(monkeypatch, script, argv, env, message):
    for name in ("WORLD_SIZE", *TORCHRUN_ENV):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "argv", [script, *argv])
    with pytest.raises(ScriptError, match=re.escape(message)):
        load_script(script).parse_args()


def test_tcp_at_torchruns_own_store_is_accepted(monkeypatch):
    """The control for the refusal above: the address torchrun's agent serves is fine."""
    for name, value in {"WORLD_SIZE": "2", **TORCHRUN_ENV}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "argv", ["ch2_process_groups.py", "--init-method", "tcp://127.0.0.1:29400"])
    assert load_script("ch2_process_groups.py").parse_args().init_method == "tcp://127.0.0.1:29400"


@pytest.mark.parametrize("text, problem", [("64kb", "expected a size"), ("0", "at least 1"),
                                           ("1.5", "whole number"), ("inf", "whole number")])
def test_sizes_in_bytes_are_parsed_or_refused(text, problem, monkeypatch, capsys):
    assert [byte_size(t) for t in ("4", "8B", "64KiB", "1.5MiB", "2GiB")] == [4, 8, 65536, 1572864, 2**31]
    assert [format_bytes(n) for n in (4, 65536, 1572864)] == ["4 B", "64 KiB", "1.5 MiB"]
    monkeypatch.setattr(sys, "argv", ["ch2_bandwidth.py", "--max-bytes", text])
    with pytest.raises(SystemExit) as exit_info:
        load_script("ch2_bandwidth.py").parse_args()
    assert exit_info.value.code == 2 and problem in capsys.readouterr().err



THP_DISABLED_FLAG = """
import ctypes, sys
from dtbook.measure import fault_in_base_pages
prctl = ctypes.CDLL(None).prctl
prctl(41, 0, 0, 0, 0)  # PR_SET_THP_DISABLE off: the flag is inherited, the parent's may be set
if sys.argv[1] == "base":
    fault_in_base_pages()
print(prctl(42, 0, 0, 0, 0))  # PR_GET_THP_DISABLE
"""


@pytest.mark.skipif(sys.platform != "linux", reason="transparent huge pages are Linux's")
def test_page_faults_are_counted_with_huge_pages_off_for_the_process():
    """2.4's and 2.5's fresh-page asserts divide faults by 4 KiB pages, which a system whose
    THP setting is "always" would break (one fault, 2 MiB). The kernel's own flag says the
    process turned them off; the control, a process that did not (its inherited flag cleared
    first), has it clear. (This VM
    maps no anonymous huge pages at all, so the fault counts themselves cannot show it.)"""
    import subprocess

    flag = {how: subprocess.run([sys.executable, "-c", THP_DISABLED_FLAG, how], check=True,
                                capture_output=True, text=True).stdout.strip()
            for how in ("default", "base")}
    assert flag == {"default": "0", "base": "1"}

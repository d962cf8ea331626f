"""scripts/ch7_compile_benchmark.py: its cache bookkeeping and its one-line refusal (in-process).

The benchmark itself runs in the book build (notebooks/ch7_performance/05), which asserts the
losses; its timings are printed there, never tested.
"""

import shutil

from support import load_script, run_in_process


def test_use_cache_reports_an_empty_cache_then_a_filled_one(tmp_path, monkeypatch):
    benchmark = load_script("ch7_compile_benchmark.py")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "")  # restored after the test
    cache = tmp_path / "inductor"
    assert benchmark.use_cache(cache) == (str(cache.resolve()), True)
    (cache / "fxgraph").mkdir()
    assert benchmark.use_cache(cache) == (str(cache.resolve()), False)


def test_inductor_without_a_cpp_compiler_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    code = run_in_process("ch7_compile_benchmark.py", "--compiler", "inductor",
                          monkeypatch=monkeypatch)
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip().splitlines() == [
        "error: --compiler inductor needs a C++ compiler (g++ or clang++) on the PATH on a CPU; "
        "install one or use --compiler aot_eager"]

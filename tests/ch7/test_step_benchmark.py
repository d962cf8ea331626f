"""Chapter 7, section 6: the step benchmark's help and its one-line refusals, in process.

Timings are not tested. That the naive loop computes DDP's gradients, and that the control (a
rank's own gradients) does not, is asserted by the section's notebook on the lab, which
`make test` executes; relaunching the script here would only repeat it. The exposed fraction it prints is
`dtbook.exposed.exposed_fraction`, tested with its controls in tests/lib/test_exposed_fraction.py.
"""

from support import run_in_process


def test_help_shows_the_definitions(monkeypatch, capsys):
    assert run_in_process("ch7_step_benchmark.py", "--help", monkeypatch=monkeypatch) == 0
    assert "exposed = waited_ddp / T_comm" in capsys.readouterr().out


def test_gradient_check_on_one_process_is_refused_in_one_line(monkeypatch, capsys):
    code = run_in_process("ch7_step_benchmark.py", "--check-gradients", monkeypatch=monkeypatch)
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: --check-gradients") and len(err.splitlines()) == 1


def test_bucket_cap_must_be_positive(monkeypatch, capsys):
    code = run_in_process("ch7_step_benchmark.py", "--bucket-caps", "0", monkeypatch=monkeypatch)
    assert code == 2 and "must be a finite number greater than 0" in capsys.readouterr().err

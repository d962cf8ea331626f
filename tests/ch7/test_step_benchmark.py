"""Chapter 7, section 6: the step benchmark's help, its one-line refusals and its exposed fraction, in process.

Timings are not tested. That the naive loop computes DDP's gradients, and that the control (a
rank's own gradients) does not, is asserted by the section's notebook on the lab, which
`make test` executes; relaunching the script here would only repeat it.
"""

from support import load_script, run_in_process


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


def test_an_exposed_fraction_needs_communication_that_stands_out_of_the_noise():
    program = load_script("ch7_step_benchmark.py")
    # 7.3's world of one in one build: 1.0 ms of "T_comm" stood out of T_ddp's spread alone.
    row = {"t_ddp_ms": 18.5, "t_ddp_p25_ms": 18.1, "t_ddp_p75_ms": 18.6,
           "t_local_ms": 17.4, "t_local_p25_ms": 17.2, "t_local_p75_ms": 17.5,
           "t_comm_ms": 1.0, "waited_ddp_ms": 0.5}
    assert program.exposed_fraction(row, world_size=2) == 0.5  # the control: two processes
    assert program.exposed_fraction(row, world_size=1) is None
    # 7.6 on this machine in one build: T_comm 6.5 ms, inside T_local's spread of 17 ms
    noisy = {**row, "t_local_p25_ms": 17.0, "t_local_p75_ms": 34.0, "t_comm_ms": 6.5}
    assert program.exposed_fraction(noisy, world_size=2) is None

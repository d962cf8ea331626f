"""Every companion script is a proper command-line program: --help, and one-line errors for bad flags.

These run in-process (each script is imported as a module and its parse_args called), which costs
milliseconds instead of a Python start-up per script; tests/ch3/test_train.py runs the same
contract end to end through a real process.
"""

import sys

import pytest

from support import SCRIPTS, load_script

PROGRAMS = sorted(p for p in SCRIPTS.glob("ch*.py"))


def parse(script, monkeypatch, *argv):
    monkeypatch.setattr(sys, "argv", [script.name, *argv])
    with pytest.raises(SystemExit) as exit_info:
        load_script(script.name).parse_args()
    return exit_info.value.code


def test_every_script_is_found():
    assert len(PROGRAMS) >= 11, [p.name for p in PROGRAMS]


@pytest.mark.parametrize("script", PROGRAMS, ids=lambda p: p.name)
def test_help_names_the_shared_flags(script, monkeypatch, capsys):
    assert parse(script, monkeypatch, "--help") == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:")
    assert "--backend" in out and "--metrics" in out


@pytest.mark.parametrize("script", PROGRAMS, ids=lambda p: p.name)
def test_unknown_flag_is_rejected_in_one_line(script, monkeypatch, capsys):
    assert parse(script, monkeypatch, "--no-such-flag") == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --no-such-flag" in err
    assert "Traceback" not in err

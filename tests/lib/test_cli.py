"""dtbook.cli.run_main: a ScriptError is one line and exit status 2; a rank that lingers
after it (for its partners to report, before torchrun stops them all) has printed first."""

import pytest

from dtbook import cli


def test_a_lingering_error_prints_its_line_before_it_waits(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    waits = []
    monkeypatch.setattr(cli.time, "sleep", lambda s: waits.append((s, capsys.readouterr().err)))

    def main():
        raise cli.ScriptError("the partner is gone", linger_s=2.0)

    with pytest.raises(SystemExit) as exit_info:
        cli.run_main(main)
    assert exit_info.value.code == 2
    assert waits == [(2.0, "error: the partner is gone\n")]

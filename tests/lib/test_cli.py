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


def test_the_error_line_is_one_write_so_two_ranks_cannot_interleave_it(monkeypatch):
    # Two ranks share torchrun's pipe; a line written in two pieces (text, then newline, as
    # print() does unbuffered) let a fresh-clone run read "...rank_1[rank 0] error: ..." as one line.
    writes = []

    class Recorder:
        def write(self, text):
            writes.append(text)

        def flush(self):
            pass

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(cli.sys, "stderr", Recorder())

    def main():
        raise cli.ScriptError("timed out")

    with pytest.raises(SystemExit):
        cli.run_main(main)
    assert writes == ["[rank 1] error: timed out\n"]

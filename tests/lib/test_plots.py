"""dtbook.plots: the curves drawn are the runs' logged losses, and the first run is the reference."""

import matplotlib
import pytest

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from dtbook.launch import RunResult  # noqa: E402
from dtbook.plots import REFERENCE_STYLE, loss_curve, plot_loss_curves  # noqa: E402


def run_with(losses: dict[int, float]) -> RunResult:
    records = [{"event": "step", "step": s, "loss": v} for s, v in losses.items()]
    return RunResult(command=[], returncode=0, output="", seconds=0.0, metrics=[{"event": "config"}, *records])


def test_curves_are_the_logged_losses_and_the_reference_is_drawn_first():
    reference, other = run_with({1: 3.0, 2: 2.5}), {1: 3.1, 2: 2.7}
    curves = plot_loss_curves({"reference": reference, "other": other}, marks={"crash": 2})
    assert curves == {"reference": {1: 3.0, 2: 2.5}, "other": other}
    lines = plt.gca().get_lines()
    assert [list(line.get_ydata()) for line in lines[:2]] == [[3.0, 2.5], [3.1, 2.7]]
    assert lines[0].get_linewidth() == REFERENCE_STYLE["lw"] and lines[1].get_linewidth() < REFERENCE_STYLE["lw"]
    assert lines[2].get_label() == "crash" and list(lines[2].get_xdata()) == [2, 2]
    plt.close("all")


def test_loss_curve_takes_a_dict_as_it_is():
    points = {5: 1.0}
    assert loss_curve(points) is points


def test_download_role_ships_a_gzip_and_names_it_from_the_source_root(tmp_path, monkeypatch):
    import gzip

    from dtbook import plots

    monkeypatch.setattr(plots, "DOWNLOADS_DIR", tmp_path / "downloads")
    trace = tmp_path / "rank0.json"
    trace.write_text('{"traceEvents": []}')
    role = plots.download_role(trace, "step.json.gz")
    assert role == "{download}`step.json.gz </runs/downloads/step.json.gz>`"
    assert gzip.decompress((tmp_path / "downloads" / "step.json.gz").read_bytes()) == trace.read_bytes()
    with pytest.raises(ValueError, match="ends in .gz"):
        plots.download_role(trace, "step.json")

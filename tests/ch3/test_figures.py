"""Chapter 3's diagrams are current and correct."""

import ch3_figures
import pytest


@pytest.mark.parametrize("name", sorted(ch3_figures.FIGURE_FUNCTIONS))
def test_figure_files_are_what_the_generator_draws(name):
    """book/figures/*.svg are generated; a hand edit or a stale file would drift from the code."""
    on_disk = (ch3_figures.FIGURES / name).read_text()
    assert on_disk == ch3_figures.FIGURE_FUNCTIONS[name](), "run: python tools/ch3_figures.py"
    assert on_disk.startswith("<svg") and "http" not in on_disk.replace(
        'xmlns="http://www.w3.org/2000/svg"', ""), "no external references: it renders offline"


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_allreduce_figure_runs_the_algorithm(world):
    states = ch3_figures.ring_allreduce_states(world)
    everyone = frozenset(range(world))
    assert len(states) == 2 * (world - 1) + 1  # start, W-1 reduce-scatter, W-1 all-gather steps
    _, after_reduce_scatter, _ = states[world - 1]
    for rank in range(world):  # each rank owns exactly one complete chunk, the one after its own
        complete = [c for c in range(world) if after_reduce_scatter[rank][c] == everyone]
        assert complete == [(rank + 1) % world]
    _, final, _ = states[-1]
    assert all(chunk == everyone for row in final for chunk in row)
    for _, _, sends in states[1:]:  # every rank sends exactly one chunk per step
        assert sorted(rank for rank, _ in sends) == list(range(world))

"""Draw chapter 3's diagrams as SVG files in book/figures/.

    python tools/ch3_figures.py            # rewrite the figures
    python tools/ch3_figures.py --check    # exit 1 if a figure on disk is out of date

The figures are drawn from a few numbers (ranks, chunks, layers, buckets), not by hand, so a
change to one of them redraws every box and arrow consistently. The ring all-reduce figure is
computed by running the algorithm on labels: what each box says is what that rank holds.
Plain SVG with generic font families: it renders offline in any browser.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

FIGURES = Path(__file__).resolve().parent.parent / "book" / "figures"
FONT = "font-family:DejaVu Sans,Helvetica,Arial,sans-serif"
INK = "#222"
# One colour per number of ranks summed into a chunk: 1 (own data) ... W (the full sum).
SUM_COLOURS = ["#e8eef7", "#9ecae1", "#3182bd", "#08519c"]
BUCKET_COLOURS = ["#fdae6b", "#74c476", "#9e9ac8", "#fd8d3c"]


class Svg:
    """Just enough SVG: boxes, text and arrows, collected and written as one string."""

    def __init__(self, width: int, height: int, title: str):
        self.width, self.height = width, height
        self.items = [f"<title>{title}</title>",
                      '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" '
                      'markerWidth="7" markerHeight="7" orient="auto-start-reverse">'
                      f'<path d="M0,0 L10,5 L0,10 z" fill="{INK}"/></marker></defs>',
                      f'<rect width="{width}" height="{height}" fill="white"/>']

    def box(self, x, y, w, h, fill="white", stroke=INK, rx=4, dash=False, thick=1.2):
        extra = ' stroke-dasharray="5,3"' if dash else ""
        self.items.append(f'<rect x="{x:g}" y="{y:g}" width="{w:g}" height="{h:g}" rx="{rx}" '
                          f'fill="{fill}" stroke="{stroke}" stroke-width="{thick}"{extra}/>')

    def text(self, x, y, words, size=13, anchor="middle", weight="normal", fill=INK):
        words = words.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        self.items.append(f'<text x="{x:g}" y="{y:g}" font-size="{size}" text-anchor="{anchor}" '
                          f'font-weight="{weight}" fill="{fill}" style="{FONT}">{words}</text>')

    def arrow(self, x1, y1, x2, y2, colour=INK, dash=False, both=False, curve=0.0):
        extra = ' stroke-dasharray="4,3"' if dash else ""
        start = ' marker-start="url(#arrow)"' if both else ""
        if curve:
            mx, my = (x1 + x2) / 2 + curve, (y1 + y2) / 2
            shape = f'<path d="M{x1:g},{y1:g} Q{mx:g},{my:g} {x2:g},{y2:g}" fill="none"'
        else:
            shape = f'<line x1="{x1:g}" y1="{y1:g}" x2="{x2:g}" y2="{y2:g}"'
        self.items.append(f'{shape} stroke="{colour}" stroke-width="1.5" '
                          f'marker-end="url(#arrow)"{start}{extra}/>')

    def render(self) -> str:
        body = "\n".join(self.items)
        return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.width}" height="{self.height}" '
                f'viewBox="0 0 {self.width} {self.height}">\n{body}\n</svg>\n')


# --------------------------------------------------------------------------
# Ring all-reduce
# --------------------------------------------------------------------------


def ring_allreduce_states(world: int) -> list[tuple[str, list[list[frozenset]], list[tuple[int, int]]]]:
    """Run ring all-reduce on labels: which ranks' data each rank holds in each chunk, step by step.

    Returns (caption, holdings[rank][chunk], sends) per step; sends lists (rank, chunk) pairs:
    rank sends that chunk to rank + 1 during the step that leads to the state shown.
    """
    holds = [[frozenset([rank]) for _ in range(world)] for rank in range(world)]
    states = [("start: every rank has its own gradient, in 3 chunks", [row[:] for row in holds], [])]
    for step in range(world - 1):  # reduce-scatter: add the neighbour's partial sum
        sends = [(rank, (rank - step) % world) for rank in range(world)]
        incoming = [(rank, chunk, holds[rank][chunk]) for rank, chunk in sends]
        for rank, chunk, part in incoming:
            holds[(rank + 1) % world][chunk] = holds[(rank + 1) % world][chunk] | part
        states.append((f"reduce-scatter step {step + 1}: send a chunk, add the one received",
                       [row[:] for row in holds], sends))
    for step in range(world - 1):  # all-gather: pass the finished sums around
        sends = [(rank, (rank + 1 - step) % world) for rank in range(world)]
        incoming = [(rank, chunk, holds[rank][chunk]) for rank, chunk in sends]
        for rank, chunk, part in incoming:
            holds[(rank + 1) % world][chunk] = part
        states.append((f"all-gather step {step + 1}: send a finished chunk, keep the one received",
                       [row[:] for row in holds], sends))
    return states


def ring_allreduce(world: int = 3) -> str:
    states = ring_allreduce_states(world)
    chunk_w, chunk_h, gap = 62, 30, 8
    panel_w = 120 + world * (chunk_w + gap)
    panel_h = 56 + world * (chunk_h + 14)
    columns = 3
    rows = -(-len(states) // columns)
    svg = Svg(columns * panel_w + 20, rows * panel_h + 130, "Ring all-reduce, step by step")
    svg.text(15, 24, f"Ring all-reduce of one tensor on {world} ranks (each rank sends to the next, "
             f"rank {world - 1} to rank 0)", size=15, anchor="start", weight="bold")
    names = "abcdefgh"
    for index, (caption, holds, _) in enumerate(states):
        px = 10 + (index % columns) * panel_w
        py = 40 + (index // columns) * panel_h
        svg.box(px, py, panel_w - 10, panel_h - 10, fill="#fafafa", stroke="#bbb")
        svg.text(px + 8, py + 18, f"{index}. {caption.split(':')[0]}", size=12, anchor="start",
                 weight="bold")
        svg.text(px + 8, py + 33, caption.split(": ", 1)[1], size=10.5, anchor="start")
        next_sends = states[index + 1][2] if index + 1 < len(states) else []
        sent = set(next_sends)
        for rank in range(world):
            y = py + 44 + rank * (chunk_h + 14)
            svg.text(px + 10, y + 20, f"rank {rank}", size=12, anchor="start")
            for chunk in range(world):
                x = px + 62 + chunk * (chunk_w + gap)
                held = holds[rank][chunk]
                sends_it = (rank, chunk) in sent
                svg.box(x, y, chunk_w, chunk_h, fill=SUM_COLOURS[len(held) - 1],
                        stroke="#d62728" if sends_it else INK, thick=3 if sends_it else 1.2)
                label = names[chunk] + "=" + "+".join(str(r) for r in sorted(held))
                svg.text(x + chunk_w / 2, y + 19, label, size=11,
                         fill="white" if len(held) >= 3 else INK)
    legend_y = 40 + rows * panel_h + 8
    svg.text(15, legend_y + 12, "a=0+1 means: chunk a holds the sum of rank 0's and rank 1's "
             "values. A red outline marks the chunk each rank sends to the next rank "
             "in the following step.", size=12, anchor="start")
    svg.text(15, legend_y + 32, f"After {world - 1} reduce-scatter steps each rank owns one "
             f"finished chunk; after {world - 1} all-gather steps every rank has all of them. "
             f"Each rank sends 2(W-1)/W of the tensor,", size=12, anchor="start")
    svg.text(15, legend_y + 50, "whatever the number of ranks W: that is why the ring is "
             "bandwidth-optimal.", size=12, anchor="start")
    for k in range(world):
        x = 15 + k * 150
        svg.box(x, legend_y + 60, 22, 16, fill=SUM_COLOURS[k])
        svg.text(x + 28, legend_y + 73, f"sum of {k + 1} rank(s)", size=11, anchor="start")
    return svg.render()


# --------------------------------------------------------------------------
# One backward pass: buckets fill, all-reduces overlap
# --------------------------------------------------------------------------


def backward_overlap(layers: int = 6, buckets: tuple[tuple[int, ...], ...] = ((6, 5), (4, 3), (2, 1))) -> str:
    """A schematic time axis: layer gradients in reverse order, buckets, overlapped all-reduces."""
    unit, left, top = 80, 150, 86
    width = left + (layers + 3) * unit + 40
    svg = Svg(width, 370, "One DDP backward pass: buckets and overlapped all-reduce")
    svg.text(15, 24, "One backward pass under DDP (schematic)", size=15, anchor="start",
             weight="bold")
    svg.text(15, 44, "Gradients arrive from the last layer to the first; each full bucket is "
             "all-reduced while backward goes on.", size=13, anchor="start")
    rows = {"backward": top, "bucket filled": top + 60, "all-reduce": top + 120}
    for label, y in rows.items():
        svg.text(left - 12, y + 22, label, size=12, anchor="end")
    bucket_of = {layer: b for b, members in enumerate(buckets) for layer in members}
    done_at = {}
    for slot, layer in enumerate(range(layers, 0, -1)):
        x = left + slot * unit
        colour = BUCKET_COLOURS[bucket_of[layer]]
        svg.box(x, rows["backward"], unit - 4, 34, fill="#eeeeee")
        svg.text(x + unit / 2 - 2, rows["backward"] + 22, f"grad L{layer}", size=12)
        svg.box(x, rows["bucket filled"], unit - 4, 34, fill=colour)
        svg.text(x + unit / 2 - 2, rows["bucket filled"] + 14, f"into bucket {bucket_of[layer]}",
                 size=10.5)
        svg.text(x + unit / 2 - 2, rows["bucket filled"] + 28, "(x 1/W)", size=10.5)
        done_at[layer] = x + unit - 4
    end_backward = left + layers * unit
    comm_y = rows["all-reduce"]
    start = left
    for b, members in enumerate(buckets):
        ready = done_at[min(members)]  # the bucket's last gradient is its lowest layer's
        start = max(start, ready)
        length = unit * 1.5
        svg.box(start, comm_y, length - 4, 34, fill=BUCKET_COLOURS[b])
        svg.text(start + length / 2 - 2, comm_y + 22, f"all-reduce {b}", size=12)
        svg.arrow(ready - 2, rows["bucket filled"] + 36, start + 6, comm_y - 2, dash=True)
        start += length
    end_comm = start - 4
    axis_y = comm_y + 62
    svg.arrow(left, axis_y, width - 20, axis_y)
    svg.text(width - 22, axis_y + 18, "time", size=12, anchor="end")
    svg.arrow(end_backward - 4, top - 12, end_backward - 4, axis_y, colour="#888", dash=True)
    svg.text(end_backward - 8, top - 18, "autograd done", size=11, anchor="end", fill="#555")
    svg.box(end_comm + 6, comm_y, unit * 0.9, 34, fill="#dddddd")
    svg.text(end_comm + 6 + unit * 0.45, comm_y + 15, "wait,", size=10.5)
    svg.text(end_comm + 6 + unit * 0.45, comm_y + 28, "copy to .grad", size=10.5)
    notes = ["Overlap: all-reduces 0 and 1 run while later gradients are still being computed.",
             "Only the last bucket's all-reduce, and the copy back into .grad, come after "
             "autograd has finished.",
             "Each gradient is scaled by 1/W (W processes) as it is copied into its bucket;",
             "the all-reduce sums the scaled values, so every rank ends with the mean."]
    for line, note in enumerate(notes):
        svg.text(15, axis_y + 30 + 18 * line, note, size=12, anchor="start")
    return svg.render()


# --------------------------------------------------------------------------
# torchrun on two nodes
# --------------------------------------------------------------------------


def torchrun_two_nodes(per_node: int = 2) -> str:
    svg = Svg(980, 520, "torchrun: agents, workers, the rendezvous store and the job store on two nodes")
    svg.text(15, 24, "torchrun on two nodes: one agent per node, one worker per GPU, "
             "two stores on node 0", size=15, anchor="start", weight="bold")
    node_w, node_h, node_y = 440, 330, 50
    store = None
    for node in range(2):
        nx = 20 + node * (node_w + 60)
        svg.box(nx, node_y, node_w, node_h, fill="#f7f7f7", stroke="#888", rx=8)
        svg.text(nx + 12, node_y + 22, f"node {node}  (host{node}: GROUP_RANK={node})", size=13,
                 anchor="start", weight="bold")
        agent_x, agent_y = nx + 20, node_y + 40
        svg.box(agent_x, agent_y, node_w - 40, 56, fill="#fff5e6")
        svg.text(agent_x + (node_w - 40) / 2, agent_y + 22, "torchrun agent", size=13, weight="bold")
        svg.text(agent_x + (node_w - 40) / 2, agent_y + 42, "starts, watches and restarts the "
                 "workers (--max-restarts)", size=11)
        if node == 0:
            # Two stores (torch 2.13, dynamic_rendezvous.py): the agents meet at the
            # rendezvous endpoint, and the group-rank-0 agent then opens a second
            # TCPStore on a free port, which MASTER_PORT gives to the workers.
            store = (agent_x + 40, agent_y + 76)
            svg.box(agent_x + 40, agent_y + 70, 182, 44, fill="#e5f5e0", dash=True)
            svg.text(agent_x + 131, agent_y + 88, "rendezvous store", size=12, weight="bold")
            svg.text(agent_x + 131, agent_y + 105, "--rdzv-endpoint=host0:29500", size=10)
            svg.box(agent_x + 242, agent_y + 70, 156, 44, fill="#fdf0f0")
            svg.text(agent_x + 320, agent_y + 88, "job store (TCPStore)", size=12, weight="bold")
            svg.text(agent_x + 320, agent_y + 105, "MASTER_PORT: a free port", size=10)
        for local in range(per_node):
            wx = nx + 20 + local * ((node_w - 40) / per_node)
            wy = node_y + 185
            ww = (node_w - 40) / per_node - 12
            rank = node * per_node + local
            svg.box(wx, wy, ww, 120, fill="#e8eef7")
            svg.text(wx + ww / 2, wy + 20, "worker: ch3_train.py", size=12, weight="bold")
            for line, text in enumerate([f"RANK={rank}  LOCAL_RANK={local}",
                                         f"WORLD_SIZE={2 * per_node}",
                                         f"LOCAL_WORLD_SIZE={per_node}",
                                         f"device cuda:{local}"]):
                svg.text(wx + ww / 2, wy + 42 + 18 * line, text, size=11)
            # left of centre, clear of the two store boxes on node 0
            svg.arrow(wx + 12, agent_y + 58, wx + 12, wy - 2, colour="#a0522d")
    # rendezvous: both agents meet at the store on node 0
    sx, sy = store
    svg.arrow(20 + node_w + 60 + 40, node_y + 68, sx + 184, sy + 18, colour="#2ca02c", dash=True,
              both=True, curve=-40)
    svg.text(node_w + 50, node_y + 132, "rendezvous:", size=11, fill="#2ca02c")
    svg.text(node_w + 50, node_y + 146, "who is who", size=11, fill="#2ca02c")
    # collectives: workers talk to each other directly
    y = node_y + node_h + 30
    svg.arrow(60, y, 900, y, colour="#1f77b4", both=True)
    svg.text(480, y - 8, "collectives (NCCL or gloo): the workers connect to each other directly, "
             "not through the agents", size=12, fill="#1f77b4")
    notes = ["Brown: each agent starts its workers and hands them their environment.",
             "Green, dashed: the agents agree on who is who at the rendezvous store; the workers' "
             "init_process_group meets at the job store",
             "that node 0's agent opens on a free port (MASTER_PORT); with "
             "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, rank 0's worker hosts it instead.",
             "A worker that dies makes its agent stop the others; with restarts left, the "
             "agents meet again and start new workers (TORCHELASTIC_RESTART_COUNT + 1)."]
    for line, note in enumerate(notes):
        svg.text(15, y + 30 + 18 * line, note, size=12, anchor="start")
    return svg.render()


FIGURE_FUNCTIONS = {
    "ch3_ring_allreduce.svg": ring_allreduce,
    "ch3_backward_overlap.svg": backward_overlap,
    "ch3_torchrun_two_nodes.svg": torchrun_two_nodes,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check that the files are up to date")
    args = parser.parse_args()
    stale = []
    FIGURES.mkdir(parents=True, exist_ok=True)
    for name, draw in FIGURE_FUNCTIONS.items():
        path = FIGURES / name
        svg = draw()
        if args.check:
            if not path.exists() or path.read_text() != svg:
                stale.append(name)
        else:
            path.write_text(svg)
            print(f"wrote {path}")
    if stale:
        print(f"out of date: {', '.join(stale)} (run python tools/ch3_figures.py)", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()

"""Chapter 3, section 2: launchers and their environment, two "nodes" on one machine, DistributedSampler.

The single-node torchrun environment and mp.spawn's are asserted by the quick run of
notebooks/ch3_ddp/02_single_and_multi_node.ipynb with the same arguments, so they are not launched again here.
"""

import math

import pytest

from dtbook.launch import launch_torchrun_nodes
from dtbook.metrics import read_metrics
from dtbook.output_filters import ExitBarrierRaceFilter
from support import run_python, run_torchrun


def worker_rows(run):
    node_of_agent = {pid: node for node, pid in enumerate(run.agent_pids)}
    return [{"rank": int(p["env"]["RANK"]), "local_rank": int(p["env"]["LOCAL_RANK"]),
             "group_rank": int(p["env"]["GROUP_RANK"]), "local_world_size": int(p["env"]["LOCAL_WORLD_SIZE"]),
             "world_size": int(p["env"]["WORLD_SIZE"]), "node": node_of_agent[p["parent_pid"]]}
            for p in run.records("process")]


def test_two_nodes_with_c10d_rendezvous_give_one_consistent_world():
    run = launch_torchrun_nodes("ch3_torchrun_env.py", nnodes=2, nproc_per_node=2, timeout=180, quiet=True)
    rows = worker_rows(run)  # every worker's parent is one of the two agents we started
    assert sorted(r["rank"] for r in rows) == [0, 1, 2, 3]
    assert {r["world_size"] for r in rows} == {4} and {r["local_world_size"] for r in rows} == {2}
    for node in (0, 1):
        mine = [r for r in rows if r["node"] == node]
        assert sorted(r["local_rank"] for r in mine) == [0, 1], "local ranks restart on each node"
        assert len({r["group_rank"] for r in mine}) == 1
    assert sorted({r["group_rank"] for r in rows}) == [0, 1]
    assert all(r["rank"] == r["group_rank"] * r["local_world_size"] + r["local_rank"] for r in rows)


def test_static_rendezvous_honors_node_rank():
    run = launch_torchrun_nodes("ch3_torchrun_env.py", nnodes=2, nproc_per_node=1, rdzv_backend="static",
                                timeout=180, quiet=True)
    rows = worker_rows(run)
    assert sorted(r["rank"] for r in rows) == [0, 1]
    assert all(r["group_rank"] == r["node"] for r in rows)


@pytest.fixture(scope="module")
def sampler_run(tmp_path_factory):
    metrics = tmp_path_factory.mktemp("sampler") / "m.jsonl"
    run_torchrun("ch3_sampler.py", "--dataset-size", 7, "--epochs", 3, "--batch-size", 3, "--accum-steps", 2,
                 "--steps", 2, "--metrics", metrics, nproc=2, timeout=180)
    return read_metrics(metrics)


def shards(metrics, case, epoch):
    rows = sorted((m for m in metrics if m.get("event") == "shard" and m["case"] == case and m["epoch"] == epoch),
                  key=lambda m: m["rank"])
    return [r["indices"] for r in rows]


def test_sampler_padding_covers_the_dataset_with_equal_shards(sampler_run):
    n, world = 7, 2
    for case in ("in order, padded", "shuffled, set_epoch"):
        parts = shards(sampler_run, case, 0)
        assert len(parts) == world and {len(p) for p in parts} == {math.ceil(n / world)}
        flat = [i for p in parts for i in p]
        assert set(flat) == set(range(n)), "every item is used"
        assert len(flat) - len(set(flat)) == math.ceil(n / world) * world - n, "only the padding repeats"


def test_sampler_drop_last_gives_disjoint_equal_shards(sampler_run):
    parts = shards(sampler_run, "in order, drop_last", 0)
    flat = [i for p in parts for i in p]
    assert {len(p) for p in parts} == {7 // 2}
    assert len(flat) == len(set(flat)), "no item on two ranks"


def test_set_epoch_changes_the_order_and_forgetting_it_does_not(sampler_run):
    with_set = [shards(sampler_run, "shuffled, set_epoch", e) for e in range(3)]
    without = [shards(sampler_run, "shuffled, no set_epoch", e) for e in range(3)]
    assert without[0] == without[1] == without[2]
    assert with_set[0] != with_set[1] and with_set[1] != with_set[2] and with_set[0] != with_set[2]


def test_shuffled_drop_last_leaves_out_the_tail_of_each_epochs_permutation(sampler_run):
    n, world = 7, 2
    kept = n // world * world
    for epoch in range(3):
        # With padding, the interleaved shards are the epoch's permutation followed by its first items again.
        padded = shards(sampler_run, "shuffled, set_epoch", epoch)
        permutation = [padded[k % world][k // world] for k in range(n)]
        dropped = shards(sampler_run, "shuffled, drop_last", epoch)
        used = [dropped[k % world][k // world] for k in range(kept)]
        assert used == permutation[:kept], "drop_last keeps the same shuffled order, cut to a multiple of W"
        left_out = set(range(n)) - set(used)
        assert left_out == set(permutation[kept:]) and len(left_out) <= world - 1


def test_effective_batch_is_batch_times_accumulation_times_world(sampler_run):
    steps = [m for m in sampler_run if m.get("event") == "optimizer_step"]
    assert len(steps) == 2
    for s in steps:
        assert s["samples"] == s["distinct"] == 3 * 2 * 2
        # float32 sums in another order: a few 1e-7 of the largest gradient entry
        assert s["max_grad_diff_vs_one_process"] < 1e-5 * s["max_abs_grad"]


def test_exit_barrier_race_report_is_condensed_and_other_lines_pass():
    report = ["[W TCPStore.cpp:138] [c10d] recvValueWithTimeout failed on SocketImpl(fd=4): Failed to recv\n",
              "Exception raised from recvBytes at Utils.hpp:787 (most recent call first):\n",
              "frame #0: c10::Error::Error() + 0x9d\n", "<omitting python frames>\n", "\n",
              "E1125 1 torch/distributed/elastic/agent/server/api.py:1008] Error waiting on exit barrier.\n",
              "E1125 1 torch/distributed/elastic/agent/server/api.py:1008] Traceback (most recent call last):\n",
              "E1125 1 torch/distributed/elastic/agent/server/api.py:1008] torch.distributed.DistNetworkError: x\n"]
    broken_pipe = ["[W TCPStore.cpp:106] [c10d] sendBytes failed on SocketImpl(fd=4): Broken pipe\n",
                   "Exception raised from sendBytes at Utils.hpp:758 (most recent call first):\n",
                   "frame #0: c10::Error::Error() + 0x9d\n", "\n"]
    echoes = ["W1126 1 torch/distributed/elastic/rendezvous/dynamic_rendezvous.py:1346] The node 'n' has "
              "failed to send a keep-alive heartbeat to the rendezvous 'r' due to an error of type "
              "RendezvousConnectionError.\n", *broken_pipe]
    race = ExitBarrierRaceFilter()
    lines = [*report[:5], *broken_pipe, *report[5:], *echoes, "next line\n"]
    shown = [out for line in lines for out in race.feed(line)]
    assert shown == [ExitBarrierRaceFilter.SUMMARY, "next line\n"]

    unrelated = ExitBarrierRaceFilter()
    lines = [report[0], "frame #0: something\n", "RANK=0 LOCAL_RANK=0\n"]
    assert [out for line in lines for out in unrelated.feed(line)] == lines


def test_rendezvous_shutdown_race_is_condensed_and_a_lone_store_warning_is_kept():
    # The form seen in chapter 7's three-node runs: the store closed under the last agent.
    stack = ["[W TCPStore.cpp:115] [c10d] recvVector failed on SocketImpl(fd=4): Failed to recv\n",
             "Exception raised from recvBytes at Utils.hpp:787 (most recent call first):\n",
             "frame #0: c10::Error::Error() + 0x9d\n", "<omitting python frames>\n", "\n"]
    shutdown = ("W1127 1 torch/distributed/elastic/rendezvous/dynamic_rendezvous.py:1298] The node "
                "'n' has failed to shutdown the rendezvous 'r' due to an error of type "
                "RendezvousConnectionError.\n")
    race = ExitBarrierRaceFilter()
    shown = [out for line in [*stack, shutdown, "next line\n"] for out in race.feed(line)]
    assert shown == [ExitBarrierRaceFilter.SHUTDOWN_SUMMARY, "next line\n"]
    # Without the shutdown line the stack is something else, and is shown in full.
    other = ExitBarrierRaceFilter()
    lines = [*stack, "RANK=0 LOCAL_RANK=0\n"]
    assert [out for line in lines for out in other.feed(line)] == lines


@pytest.mark.parametrize("script, args, message", [
    ("ch3_sampler.py", ["--dataset-size", "0"], "--dataset-size"),
    ("ch3_sampler.py", ["--accum-steps", "0"], "--accum-steps"),
    ("ch3_spawn.py", ["--nproc", "0"], "--nproc"),
    ("ch3_spawn.py", ["--nproc", "two"], "--nproc"),
])
def test_bad_input_is_one_line(script, args, message):
    done = run_python(script, *args, check=False, timeout=60)
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0]
    assert "Traceback" not in done.stderr


def test_spawn_script_refuses_to_run_under_torchrun():
    done = run_torchrun("ch3_spawn.py", nproc=1, check=False, timeout=120)
    assert done.returncode != 0
    assert "error: this script starts its own processes: run it with python" in done.stderr

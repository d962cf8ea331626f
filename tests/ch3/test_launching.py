"""Chapter 3, section 2: the launchers' failure paths and the exit-barrier filter.

The book's run of notebooks/ch3_ddp/02_single_and_multi_node.ipynb asserts the single-node and
mp.spawn environments, two nodes with a c10d rendezvous and with a static one, and every
DistributedSampler property (padding, drop_last, set_epoch, the effective batch): none of those is
launched again here.
"""

import pytest

from dtbook.output_filters import ExitBarrierRaceFilter
from support import run_python, run_torchrun


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
    errors = [line for line in done.output.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0]
    assert "Traceback" not in done.output


def test_spawn_script_refuses_to_run_under_torchrun():
    done = run_torchrun("ch3_spawn.py", nproc=1, check=False, timeout=120)
    assert done.returncode != 0
    assert "error: this script starts its own processes: run it with python" in done.output

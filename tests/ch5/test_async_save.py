"""5.3's pitfall about DCP's async_save on GPUs, run on the CPU: a default group without a CPU
backend makes the first asynchronous save raise, and "cpu:gloo,…" is the fix.

The page cannot show it (a GPU job initialised with backend="nccl" is the case); here gloo
stands in for NCCL as the group's only backend, registered for the CUDA device type, which
is what async_save looks at (torch 2.13, state_dict_saver.py). No CUDA is needed to build it.
"""

import os
import subprocess
import sys

from dtbook.ports import free_port

SAVE_WITH = """
import sys, tempfile
import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
dist.init_process_group(sys.argv[1], rank=0, world_size=1)
try:
    dcp.async_save({"w": torch.arange(3.0)}, checkpoint_id=tempfile.mkdtemp()).result()
    print("saved")
except AssertionError as err:
    print(f"refused: {err}")
dist.destroy_process_group()
"""


def save_with(backend: str) -> str:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    done = subprocess.run([sys.executable, "-c", SAVE_WITH, backend], env=env, timeout=120,
                          capture_output=True, text=True, check=True)
    return done.stdout.strip().splitlines()[-1]


def test_async_save_refuses_a_group_without_a_cpu_backend_and_cpu_gloo_fixes_it():
    assert save_with("cuda:gloo") == (
        "refused: A CPU backend must be enabled for async save; try initializing process "
        "group with 'cpu:gloo,cuda:nccl'")
    assert save_with("cpu:gloo,cuda:gloo") == "saved"  # the control: the page's fix

"""Slurm on the cluster lab: two idle nodes, one task per namespace, and the job file's defaults.

The cluster starts once for the module. The job-file tests replace torchrun with a stub that prints
what it was given, so they check the file's arithmetic and overrides without starting PyTorch.
"""

import os
import stat

import pytest

from dtbook.cluster_lab import ClusterLab
from dtbook.slurm_lab import SlurmLab

JOB_FILE = "scripts/slurm/ch3_train.sbatch"
STUB = """#!/bin/sh
echo "ARGS $*"
echo "ENV host=$(hostname) OMP_NUM_THREADS=$OMP_NUM_THREADS NCCL_DEBUG=$NCCL_DEBUG \
NCCL_DEBUG_SUBSYS=$NCCL_DEBUG_SUBSYS TORCH_DISABLE_SHARE_RDZV_TCP_STORE=$TORCH_DISABLE_SHARE_RDZV_TCP_STORE \
TORCH_ELASTIC_SHUTDOWN_TIMEOUT=$TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
"""


@pytest.fixture(scope="module")
def slurm():
    with ClusterLab(nodes=2) as lab, SlurmLab(lab, quiet=True) as cluster:
        yield cluster
    assert cluster.leftovers() == [] and lab.leftovers() == []


@pytest.fixture
def stub_path(slurm, tmp_path):
    """A PATH whose torchrun is the stub above."""
    stub = tmp_path / "bin" / "torchrun"
    stub.parent.mkdir()
    stub.write_text(STUB)
    stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
    return f"{stub.parent}:{slurm.env['PATH']}"


def test_two_idle_nodes_and_one_task_in_each_namespace(slurm):
    assert slurm.run("sinfo", "-h", "-o", "%T %D").stdout.split() == ["idle", "2"]
    tasks = slurm.run("srun", "-N2", "sh", "-c", 'echo "$(hostname) $(readlink /proc/self/ns/net)"').stdout
    seen = sorted(line.split() for line in tasks.splitlines())
    lab_namespaces = [f"net:[{os.stat(f'/run/netns/{node.netns}').st_ino}]" for node in slurm.lab.nodes]
    assert seen == [[node.hostname, ns] for node, ns in zip(slurm.lab.nodes, lab_namespaces, strict=True)]


def run_job(slurm, tmp_path, stub_path, env=None, options=()) -> tuple[int, str]:
    job = slurm.submit(JOB_FILE, ["--model", "tiny", "--max-steps", "7"],
                       options=["--gpus-per-node=0", "--cpus-per-task=2", f"--output={tmp_path}/%j.out", *options],
                       env={"PATH": stub_path, **(env or {})})
    slurm.wait(job, timeout=120)
    return job, (tmp_path / f"{job}.out").read_text()


def test_the_job_file_follows_the_allocation_by_default(slurm, tmp_path, stub_path):
    job, out = run_job(slurm, tmp_path, stub_path)
    args = [line.split()[1:] for line in out.splitlines() if line.startswith("ARGS")]
    envs = [line for line in out.splitlines() if line.startswith("ENV")]
    assert len(args) == 2 and sorted(e.split()[1] for e in envs) == ["host=node0", "host=node1"]
    a = args[0]
    assert "--nnodes=2" in a and "--nproc_per_node=1" in a  # no GPU allocated: one worker per node
    assert "--rdzv_endpoint=node0:29500" in a and f"--rdzv_id={job}" in a
    assert a[a.index("--backend") + 1] == "auto"
    assert a[a.index("--checkpoint-dir") + 1].endswith(f"/runs/slurm/ckpt-{job}")  # keyed by the job id
    assert a[-4:] == ["--model", "tiny", "--max-steps", "7"]  # the words after the file come last and win
    assert all("OMP_NUM_THREADS=2 NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET "
               "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 TORCH_ELASTIC_SHUTDOWN_TIMEOUT=30" in e
               for e in envs)


def test_exported_variables_override_the_defaults(slurm, tmp_path, stub_path):
    env = {"PROCS_PER_NODE": "2", "BACKEND": "gloo", "RDZV_PORT": "29611", "CKPT_DIR": "/shared/ckpt",
           "NCCL_DEBUG": "WARN"}
    _, out = run_job(slurm, tmp_path, stub_path, env=env)
    a = next(line.split()[1:] for line in out.splitlines() if line.startswith("ARGS"))
    assert "--nproc_per_node=2" in a and "--rdzv_endpoint=node0:29611" in a
    assert a[a.index("--backend") + 1] == "gloo" and a[a.index("--checkpoint-dir") + 1] == "/shared/ckpt"
    assert "OMP_NUM_THREADS=1 NCCL_DEBUG=WARN" in out  # 2 cores shared by 2 workers


@pytest.mark.parametrize("now", [0, 1_795_690_000.7, 7_899_999])
def test_labs_side_by_side_never_share_a_job_id(now):
    """Job ids name files (runs/slurm/metrics-<id>.jsonl): two labs running at once, in
    different slots, must number their jobs in blocks that cannot meet."""
    from dtbook.cluster_lab import SLOTS
    from dtbook.slurm_lab import first_job_id

    span, slurm_max_job_id = 8_000_000, 67_043_328
    for slot in range(SLOTS):
        first = first_job_id(slot, now)
        # the first 100,000 jobs of the lab stay inside the slot's own block
        assert slot * span < first and first + 100_000 <= (slot + 1) * span
    assert first_job_id(SLOTS - 1, now) + 100_000 <= slurm_max_job_id
    assert first_job_id(0, now + 1) != first_job_id(0, now)  # a later lab, other ids

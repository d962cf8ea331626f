"""Slurm on the cluster lab: two idle nodes, one task per namespace, and the job file's defaults.

The cluster starts once for the module. The job-file tests replace torchrun (python, for the srun
job file) with a stub that prints what it was given, so they check the file's arithmetic and
overrides without training.
"""

import stat

import pytest

from dtbook.cluster_lab import ClusterLab
from dtbook.distributed import slurm_task_variables
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
    lab_namespaces = [f"net:[{slurm.lab.netns_inode(node.index)}]" for node in slurm.lab.nodes]
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


SRUN_FILE = "scripts/slurm/ch3_train_srun.sbatch"
# In place of python: each task prints what Slurm and the job file gave it, and its arguments.
TASK_VARIABLES = ("SLURM_STEP_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_GTIDS",
                  "MASTER_ADDR", "MASTER_PORT")
PYTHON_STUB = f"""#!/bin/sh
echo "TASK host=$(hostname) {' '.join(f'{n}=${n}' for n in TASK_VARIABLES)}"
echo "ARGS $*"
"""


def test_the_srun_job_file_gives_each_task_a_rank(slurm, tmp_path):
    """Slurm's real task variables, two tasks on each node, through the translation that
    every script's start-up makes: every rank once, local ranks per node, the first host
    as the meeting point."""
    stub = tmp_path / "bin" / "python"
    stub.parent.mkdir()
    stub.write_text(PYTHON_STUB)
    stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
    job = slurm.submit(SRUN_FILE, ["--model", "tiny"],
                       options=["--gpus-per-node=0", "--ntasks-per-node=2", "--cpus-per-task=1",
                                f"--output={tmp_path}/%j.out"],
                       env={"PATH": f"{stub.parent}:{slurm.env['PATH']}", "MASTER_PORT": "29733"})
    slurm.wait(job, timeout=120)
    out = (tmp_path / f"{job}.out").read_text()
    given = [dict(field.split("=", 1) for field in line.split()[1:])
             for line in out.splitlines() if line.startswith("TASK")]
    tasks = sorted(({"host": env["host"], **slurm_task_variables(env)} for env in given),
                   key=lambda t: int(t["RANK"]))
    assert [(t["host"], t["RANK"], t["LOCAL_RANK"]) for t in tasks] == [
        ("node0", "0", "0"), ("node0", "1", "1"), ("node1", "2", "0"), ("node1", "3", "1")], out
    assert {(t["WORLD_SIZE"], t["LOCAL_WORLD_SIZE"], t["MASTER_ADDR"], t["MASTER_PORT"])
            for t in tasks} == {("4", "2", "node0", "29733")}
    args = [line.split()[1:] for line in out.splitlines() if line.startswith("ARGS")]
    assert len(args) == 4 and all(a[0] == "scripts/ch3_train.py" and a[-2:] == ["--model", "tiny"]
                                  for a in args)
    assert args[0][args[0].index("--checkpoint-dir") + 1].endswith(f"/runs/slurm/ckpt-{job}")

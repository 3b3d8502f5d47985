"""``launch/env.py``'s Slurm mapping, the one every srun task of the project uses (generate,
the smoke check): rank, world size, local rank, ranks on the node, the master node and port,
checked against values worked out by hand from Slurm's documented variables — and, where
Slurm is installed, the first host against ``scontrol show hostnames`` itself. Then the smoke
check (``python -m deinfer_megatron.launch.smoke``) as two real processes of a hand-made step.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from deinfer_megatron.launch.env import LaunchEnv, detect, first_host, slurm_port, tasks_on_node
from deinfer_megatron.launch.local import free_port
from tests.helpers.slurm import ensure_cluster, slurm_skip_reason

REPO_ROOT = str(Path(__file__).resolve().parents[2])

# Task 5 of an 8-task step on the last three of a job's five nodes (4 + 2 + 2 tasks): its node is
# the step's second (SLURM_NODEID 1), where it is the second task (SLURM_LOCALID 1).
STEP = {
    "SLURM_JOB_ID": "123456",
    "SLURM_JOB_NODELIST": "cn[0040-0044]",
    "SLURM_NTASKS": "8",
    "SLURM_STEP_ID": "0",
    "SLURM_STEPID": "0",
    "SLURM_STEP_NODELIST": "cn[0042-0044]",
    "SLURM_STEP_NUM_TASKS": "8",
    "SLURM_STEP_TASKS_PER_NODE": "4,2(x2)",
    "SLURM_NODEID": "1",
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
}


@pytest.mark.parametrize("nodelist, first", [
    ("vm", "vm"),
    ("dma,dmb", "dma"),
    ("node[07-09,12],gpu1", "node07"),
    ("gpu1,node[07-09]", "gpu1"),
    ("node[003,001-002]", "node003"),  # as listed, not sorted
    ("nid[00100-00101,00200]", "nid00100"),  # zero padding kept
    ("rack[1-2]-node[07-08]", "rack1-node07"),
    ("10.1.2.[1-2]", "10.1.2.1"),
    ("n[8-12]", "n8"),
])
def test_first_host_of_a_node_list(nodelist: str, first: str) -> None:
    assert first_host(nodelist) == first


@pytest.fixture(scope="module")
def scontrol() -> str:
    """Slurm's own ``scontrol``. Where it is missing, the tests' local cluster is brought up
    (Slurm installed with apt-get on first use, as the end-to-end Slurm tests do, and
    configured): a fresh CI machine then checks against Slurm instead of skipping this at
    collection, before the later Slurm tests had installed it."""
    if shutil.which("scontrol") is None:
        reason = slurm_skip_reason()
        if reason:
            pytest.skip(reason)
        ensure_cluster()
    return shutil.which("scontrol") or "scontrol"


@pytest.mark.parametrize("nodelist", ["node[07-09,12],gpu1", "node[003,001-002]", "nid[00100-00101,00200]",
                                      "rack[1-2]-node[07-08]", "10.1.2.[1-2]", "dma,dmb"])
def test_first_host_is_the_one_scontrol_lists_first(nodelist: str, scontrol: str) -> None:
    listed = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True,
                            check=True, timeout=30).stdout.split()
    assert first_host(nodelist) == listed[0]


@pytest.mark.parametrize("nodelist", ["", "node[01-04", "[]", "a[[1]]"])
def test_a_node_list_that_cannot_be_read_names_itself_and_the_fix(nodelist: str) -> None:
    with pytest.raises(RuntimeError, match=r"Slurm node list .*set MASTER_ADDR"):
        first_host(nodelist)


def test_the_port_comes_from_the_job_id() -> None:
    assert slurm_port(123456) == 15000 + 3456
    assert slurm_port(4242) == 19242
    assert slurm_port(10000) == 15000
    # Jobs numbered one after the other share no port, across the wrap at 10000 too.
    assert len({slurm_port(j) for j in range(19990, 20010)}) == 20


def test_tasks_on_each_node() -> None:
    assert [tasks_on_node("4,2(x2)", n) for n in range(3)] == [4, 2, 2]
    assert [tasks_on_node("2(x3),1", n) for n in range(4)] == [2, 2, 2, 1]
    assert tasks_on_node("8", 0) == 8
    with pytest.raises(RuntimeError, match="set LOCAL_WORLD_SIZE"):
        tasks_on_node("2(x2)", 2)
    with pytest.raises(RuntimeError, match="set LOCAL_WORLD_SIZE"):
        tasks_on_node("2[x2]", 0)


def test_a_task_of_a_multi_node_step() -> None:
    # The master is the step's first node (cn0042), not the job's (cn0040).
    assert detect(STEP) == LaunchEnv(rank=5, world_size=8, local_rank=1, master_addr="cn0042",
                                     master_port=18456, launcher="slurm", local_world_size=2)


def test_a_step_on_fewer_tasks_than_the_job() -> None:
    # `srun -n2` in an 8-task job: the step's task count is the world, not the job's.
    env = {**STEP, "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_NODEID": "0",
           "SLURM_PROCID": "1", "SLURM_STEP_NODELIST": "cn0043"}
    assert detect(env) == LaunchEnv(rank=1, world_size=2, local_rank=1, master_addr="cn0043",
                                    master_port=18456, launcher="slurm", local_world_size=2)


def test_the_batch_script_is_no_rank() -> None:
    # sbatch's script sees SLURM_PROCID=0 but no step id: a command there starts its own ranks.
    batch = {k: v for k, v in STEP.items() if not k.startswith("SLURM_STEP")}
    assert detect(batch) is None
    assert detect({}) is None


def test_an_older_slurm_with_only_slurm_stepid() -> None:
    env = {k: v for k, v in STEP.items() if k != "SLURM_STEP_ID"}
    assert detect(env) == detect(STEP)


def test_master_addr_and_port_given_to_the_job_win() -> None:
    got = detect({**STEP, "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29999"})
    assert (got.master_addr, got.master_port, got.rank) == ("10.0.0.7", 29999, 5)


def test_torchrun_inside_an_srun_step_is_torchrun() -> None:
    env = {**STEP, "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4",
           "MASTER_ADDR": "cn0042", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x"}
    assert detect(env) == LaunchEnv(rank=3, world_size=4, local_rank=3, master_addr="cn0042",
                                    master_port=29500, launcher="torchrun", local_world_size=4)


def test_a_step_without_its_job_id_says_what_is_missing() -> None:
    env = {k: v for k, v in STEP.items() if k != "SLURM_JOB_ID"}
    with pytest.raises(RuntimeError, match="no SLURM_JOB_ID; start the ranks with srun"):
        detect(env)


def test_export_writes_torch_distributed_variables(monkeypatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, "")  # records the variable's state, so that what export() writes is undone
        monkeypatch.delenv(name)
    detect(STEP).export()
    assert {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                       "MASTER_ADDR", "MASTER_PORT")} == {
        "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "cn0042", "MASTER_PORT": "18456"}


def _clean_env() -> dict[str, str]:
    launch = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "TORCHELASTIC_RUN_ID")
    return {k: v for k, v in os.environ.items() if k not in launch and not k.startswith("SLURM_")}


def test_smoke_check_as_two_tasks_of_a_step() -> None:
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = {**_clean_env(), "SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "localhost",
               "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_NODEID": "0",
               "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "MASTER_PORT": str(port),
               "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": REPO_ROOT}
        procs.append(subprocess.Popen([sys.executable, "-m", "deinfer_megatron.launch.smoke"], env=env,
                                      cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=120) for p in procs]
    for rank, (proc, (out, err)) in enumerate(zip(procs, outs)):
        assert proc.returncode == 0, err
        assert out == f"rank={rank} world=2 sum=1\n", (out, err)
        assert f"slurm rank={rank} world=2 local_rank={rank} master=localhost:{port}" in err


def test_smoke_check_outside_a_launcher_is_one_line() -> None:
    proc = subprocess.run([sys.executable, "-m", "deinfer_megatron.launch.smoke"], cwd=REPO_ROOT,
                          env={**_clean_env(), "PYTHONPATH": REPO_ROOT}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        ("deinfer_megatron.launch.smoke: error: no launcher started this process; run it in every task of "
         "an srun step (scripts/slurm/smoke.sbatch) or under torchrun")]

"""End to end: a real single-node Slurm cluster runs a 2-rank gloo job.

Brings the cluster up with scripts/slurm/local_cluster.sh (apt-get installs
slurm-wlm + munge on first use), submits scripts/slurm/smoke.sbatch and checks
that the Slurm -> torch.distributed mapping produced a working process group.

Skipped only when not root or when Slurm is neither installed nor installable
(no apt-get); any failure to bring the cluster up is a test failure.
"""

from __future__ import annotations

import re
import time

import pytest

try:
    from tests.slurm_util import ensure_cluster, run_sbatch, slurm_skip_reason
except ImportError:  # tests/ not importable as a package
    from slurm_util import ensure_cluster, run_sbatch, slurm_skip_reason  # type: ignore[no-redef]

_RANK_LINE = re.compile(r"^rank=(\d+) world=(\d+) sum=(\d+)\s*$", re.MULTILINE)


@pytest.fixture(scope="module")
def slurm_cluster() -> None:
    reason = slurm_skip_reason()
    if reason:
        pytest.skip(reason)
    ensure_cluster()  # raises (-> test error) if the cluster cannot be brought up


def test_smoke_sbatch_two_ranks_all_reduce(slurm_cluster: None) -> None:
    t0 = time.monotonic()
    rc, out = run_sbatch("scripts/slurm/smoke.sbatch", "--ntasks=2", "--nodes=1", timeout=240)
    elapsed = time.monotonic() - t0
    print(f"smoke job took {elapsed:.1f}s")
    assert rc == 0, f"smoke.sbatch exited {rc}; output:\n{out}"

    ranks = {int(r): (int(w), int(s)) for r, w, s in _RANK_LINE.findall(out)}
    assert sorted(ranks) == [0, 1], f"expected one line per rank 0 and 1; output:\n{out}"
    for rank, (world, total) in ranks.items():
        assert world == 2, f"rank {rank}: world={world}, expected 2; output:\n{out}"
        assert total == 0 + 1, f"rank {rank}: sum={total}, expected 1; output:\n{out}"

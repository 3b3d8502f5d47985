"""A stage is built where its job runs: the rank's GPU under NCCL, the CPU under gloo.

On a CPU-only machine this checks the CPU half (gloo, parameters and logits on the CPU, CPU
token ids accepted); ``tests/gpu`` checks the CUDA half on a GPU machine.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.helpers.distributed import run_ranks


def _where() -> dict[str, Any]:
    import torch.distributed as dist

    from deinfer_megatron.arch.model import arch_from_hf_config
    from deinfer_megatron.models.build import build_stage, load_weights
    from deinfer_megatron.models.pipeline import stage_forward
    from deinfer_megatron.parallel.runtime import init_parallel, job_device, shutdown
    from deinfer_megatron.specs.layout import Layout
    from deinfer_megatron.specs.rank_config import RankConfig
    from tests.helpers.tiny_models import random_hf_model

    before = str(job_device())
    groups = init_parallel(1, 1)
    try:
        hf = random_hf_model("llama")
        arch = arch_from_hf_config(hf.config.to_dict())
        stage = build_stage(arch, RankConfig.dense(arch), Layout.DENSE, groups)
        load_weights(stage, hf.state_dict(), RankConfig.dense(arch))
        ids = torch.tensor([[3, 14, 15, 92]])
        logits = stage_forward(stage, ids, torch.arange(4).unsqueeze(0))
        return {"before": before, "backend": dist.get_backend(), "groups": str(groups.device),
                "stage": str(stage.device), "params": sorted({str(p.device) for p in stage.model.parameters()}),
                "logits": str(logits.device)}
    finally:
        shutdown()


def test_the_stage_lives_on_the_jobs_device() -> None:
    got = run_ranks(1, _where, timeout=120)[0]
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    assert got == {"before": "cpu", "backend": "nccl" if device != "cpu" else "gloo", "groups": device,
                   "stage": device, "params": [device], "logits": device}

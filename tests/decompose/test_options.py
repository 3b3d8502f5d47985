"""``decompose --update sequential`` and ``--allocation fisher`` end to end on a tiny LLaMA,
checked against activations computed here with transformers."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file

from deinfer_megatron.decompose.allocation import factor_ceiling, uniform_rank
from deinfer_megatron.decompose.job import DecomposeJob, run_decompose
from deinfer_megatron.decompose.update import UPDATE_DAMP
from tests.helpers.text import real_text_file
from tests.helpers.tiny_models import save_tiny_folder

TOKENS, SEQ = 512, 64
ATTN = "model.layers.0.self_attn"


def _o_proj_input(model, ids: torch.Tensor) -> torch.Tensor:
    """What layer 0's o_proj reads, as (tokens, in)."""
    seen = []
    handle = model.get_submodule(f"{ATTN}.o_proj").register_forward_pre_hook(lambda _m, a: seen.append(a[0]))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        handle.remove()
    return seen[0].reshape(-1, seen[0].shape[-1]).double()


def test_update_and_fisher_allocation(tmp_path: Path) -> None:
    hf = save_tiny_folder("llama", tmp_path / "dense")
    calib = real_text_file(tmp_path, 20_000, "calibration")
    common = dict(method="svd-llm", ratio=0.5, calib_text=calib, calib_tokens=TOKENS, calib_seq_len=SEQ)

    # --update sequential: layer 0's o_proj is fit to the dense model's output from the input it
    # reads once q, k, v are decomposed
    out = run_decompose(DecomposeJob(tmp_path / "dense", update="sequential", out=tmp_path / "upd", **common))
    manifest = json.loads((out / "deinfer_manifest.json").read_text())
    assert manifest["update"] == "sequential" and manifest["allocation"] == "uniform"
    factors = load_file(out / "model.safetensors")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "dense")
    ids = torch.tensor(tok(calib.read_text(), add_special_tokens=False)["input_ids"][:TOKENS]).view(-1, SEQ)
    x_d = _o_proj_input(hf, ids)
    w = hf.get_submodule(f"{ATTN}.o_proj").weight.detach().double()
    with torch.no_grad():
        for p in ("q_proj", "k_proj", "v_proj"):
            hf.get_submodule(f"{ATTN}.{p}").weight.copy_(factors[f"{ATTN}.{p}.u"] @ factors[f"{ATTN}.{p}.v"])
    x_s = _o_proj_input(hf, ids)
    u, v = factors[f"{ATTN}.o_proj.u"].double(), factors[f"{ATTN}.o_proj.v"].double()
    target = x_d @ w.T
    residual = target - x_s @ v.T @ u.T
    # V was the last step: the gradient of ‖target − X_s Vᵀ Uᵀ‖² + λ‖W − UV‖² in V vanishes
    lam = UPDATE_DAMP * (x_s * x_s).sum(0).mean()
    grad_v = u.T @ residual.T @ x_s + lam * u.T @ (w - u @ v)
    assert grad_v.norm() <= 1e-5 * (u.T @ target.T @ x_s).norm()  # 1.5e-7 measured: float32 factors
    # and the fit beats the best rank-r approximation of W on that input (svd-llm without update)
    s = torch.linalg.cholesky(x_s.T @ x_s)
    p, sigma, qt = torch.linalg.svd(w @ s)
    r = u.shape[1]
    w_r = (p[:, :r] * sigma[:r]) @ torch.linalg.solve_triangular(s, qt[:r], upper=False, left=False)
    assert (residual**2).sum() < 0.9 * ((target - x_s @ w_r.T) ** 2).sum()  # 0.63 measured

    # --allocation fisher: one budget, the uniform rule's total, spent to within one rank step
    out = run_decompose(DecomposeJob(tmp_path / "dense", allocation="fisher", out=tmp_path / "fisher", **common))
    manifest = json.loads((out / "deinfer_manifest.json").read_text())
    assert manifest["allocation"] == "fisher" and manifest["update"] == "none"
    ranks = {k: int(v) for k, v in json.loads((out / "rank_config.json").read_text()).items()}
    shapes = {n: tuple(m.weight.shape) for n, m in hf.named_modules()
              if isinstance(m, torch.nn.Linear) and n.startswith("model.layers")}
    budget = sum(uniform_rank(*s, 0.5) * sum(s) for s in shapes.values())
    left = budget - sum(ranks[n] * sum(s) if n in ranks else s[0] * s[1] for n, s in shapes.items())
    assert 0 <= left
    assert all(left < sum(shapes[n]) for n, k in ranks.items() if k < factor_ceiling(*shapes[n]))
    kinds: dict[str, list[int]] = {}  # per kind of matrix: [parameters kept, its uniform budget]
    for n, shape in shapes.items():
        kept = ranks[n] * sum(shape) if n in ranks else shape[0] * shape[1]
        got = kinds.setdefault(n.split(".", 3)[3], [0, 0])
        got[0], got[1] = got[0] + kept, got[1] + uniform_rank(*shape, 0.5) * sum(shape)
    assert any(kept > budget for kept, budget in kinds.values()), f"one pool, unlike variadic's per kind: {kinds}"

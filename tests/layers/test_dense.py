"""Megatron's dense attention as the cost model prices it (``layers.dense``).

The price of a dense attention block at a decode step includes RoPE applied again to every
cached key (``Attend.rotary``) because Megatron-Core's static-batching ``SelfAttention`` caches
keys *before* RoPE and rotates the whole cache at each step. That is Megatron's behaviour, not
ours, so it is checked here against Hugging Face: after a prefill, the keys in Megatron's cache
are the un-rotated ``k_proj`` outputs of the same model. Should an upgrade cache rotated keys,
this fails and the price must change with it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from deinfer_megatron.launch.run import run_on_ranks
from tests.helpers.tiny_models import random_hf_model


def _cached_keys(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    from deinfer_megatron.generation.context import GenerationContext
    from deinfer_megatron.models.build import load_folder
    from deinfer_megatron.models.pipeline import stage_forward
    from deinfer_megatron.parallel.runtime import init_parallel, shutdown
    from deinfer_megatron.specs.layout import Layout

    groups = init_parallel(1, 1)
    try:
        stage = load_folder(folder, Layout.DENSE, groups)
        b, s = ids.shape
        context = GenerationContext(b, s + 1)
        with torch.no_grad():
            stage_forward(stage, ids, torch.arange(s).expand_as(ids), inference_context=context)
        keys, _ = context.key_value_memory_dict[1]  # Megatron's layer numbers start at 1
        return keys[:s, :b].clone()
    finally:
        shutdown()


def test_megatrons_static_cache_holds_keys_before_rope(tmp_path: Path) -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    hf = random_hf_model("llama", seed=5)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    ids = torch.randint(3, hf.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    seen = []
    attn = hf.model.layers[0].self_attn
    hook = attn.k_proj.register_forward_hook(lambda m, args, out: seen.append(out))
    with torch.no_grad():
        hf(ids)
    hook.remove()
    b, s = ids.shape
    d = attn.head_dim
    raw = seen[0].view(b, s, -1, d)  # [b, s, kv heads, d], before RoPE
    position_ids = torch.arange(s).expand(b, s)
    cos, sin = hf.model.rotary_emb(raw, position_ids)
    rotated, _ = apply_rotary_pos_emb(raw.transpose(1, 2), raw.transpose(1, 2), cos, sin)

    cached = run_on_ranks(1, _cached_keys, tmp_path, ids).permute(1, 0, 2, 3)  # → [b, s, kv, d]
    torch.testing.assert_close(cached, raw, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(cached, rotated.transpose(1, 2), atol=1e-3), \
        "Megatron's cache now holds rotated keys: Attend.rotary no longer describes dense attention"

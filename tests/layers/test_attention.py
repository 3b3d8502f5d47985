"""Decomposed self-attention in one process: a prefill, then single-token decode steps, under
each KV cache (full K/V; rank-r latents with value absorption off and on), against a plain-torch
reference built from the multiplied-out weights, RoPE applied by position, over the whole
sequence at once (what a correct cache must reproduce)."""

from __future__ import annotations

import math
import types

import pytest
import torch

from megatron.core.inference.contexts.static_context import StaticInferenceContext
from megatron.core.transformer.enums import AttnMaskType

from deinfer_megatron.arch.model import arch_from_hf_config, transformer_config
from deinfer_megatron.arch.ranks import AttentionRanks
from deinfer_megatron.layers.attention import FactoredSelfAttention
from deinfer_megatron.layers.core_attention import SdpaCoreAttention
from deinfer_megatron.layers.kv_cache import CacheKind, FullKVCache, LatentKVCache
from deinfer_megatron.parallel.topology import TPView
from deinfer_megatron.specs.builder import factored_attention_submodules
from deinfer_megatron.specs.layout import Layout
from tests.helpers.tiny_models import TINY_CONFIGS

RANKS = AttentionRanks(q=13, k=7, v=9, o=11)
PREFILL, DECODE, BATCH = 5, 3, 2
TOL = 1e-5


class OneRankGroup:
    """The context-parallel group of a single process: Megatron's RoPE asks only its size."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def factors(arch, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random factors (HF orientation: V (r, in), U (out, r)) and biases, scaled to keep
    activations of order one."""
    h, d = arch.hidden_size, arch.head_dim
    out_of = {"q": arch.num_heads * d, "k": arch.num_kv_heads * d, "v": arch.num_kv_heads * d, "o": h}
    in_of = {"q": h, "k": h, "v": h, "o": arch.num_heads * d}
    w = {}
    for name in "qkvo":
        r = getattr(RANKS, name)
        w[f"v_{name}"] = torch.randn(r, in_of[name], generator=gen, dtype=torch.float64) / in_of[name] ** 0.5
        w[f"u_{name}"] = torch.randn(out_of[name], r, generator=gen, dtype=torch.float64) / r**0.5
        w[f"b_{name}"] = 0.1 * torch.randn(out_of[name], generator=gen, dtype=torch.float64)
    return w


def load(block: FactoredSelfAttention, w: dict[str, torch.Tensor], arch) -> None:
    def put(module, name, source, shard=0):
        loader, _ = module.loader_for(name)
        loader(getattr(module, name), source.float(), shard)

    with torch.no_grad():
        for s, name in enumerate("qkv"):
            put(block.linear_qkv_down, "weight", w[f"v_{name}"], s)
            up = getattr(block, f"linear_{name}_up")
            put(up, "weight", w[f"u_{name}"])
            if up.bias is not None:
                put(up, "bias", w[f"b_{name}"])
        put(block.linear_proj.down, "weight", w["v_o"])
        put(block.linear_proj.up, "weight", w["u_o"])
        if block.linear_proj.up.bias is not None:
            put(block.linear_proj.up, "bias", w["b_o"])


def reference(x: torch.Tensor, w: dict[str, torch.Tensor], arch) -> torch.Tensor:
    """Causal attention over the whole sequence with W = U·V, in float64, written out by hand."""
    t, b, _ = x.shape
    d, nq, nkv = arch.head_dim, arch.num_heads, arch.num_kv_heads
    x = x.double()

    def proj(name: str, inp: torch.Tensor, bias: bool) -> torch.Tensor:
        out = inp @ (w[f"u_{name}"] @ w[f"v_{name}"]).T
        return out + w[f"b_{name}"] if bias else out

    q = proj("q", x, arch.qkv_bias).view(t, b, nq, d)
    k = proj("k", x, arch.qkv_bias).view(t, b, nkv, d)
    v = proj("v", x, arch.qkv_bias).view(t, b, nkv, d)
    if arch.family != "opt":  # RoPE by position (rotate-half convention)
        inv = 1.0 / arch.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        angle = torch.arange(t, dtype=torch.float64)[:, None] * inv[None]
        cos = torch.cat([angle.cos(), angle.cos()], -1)[:, None, None]
        sin = torch.cat([angle.sin(), angle.sin()], -1)[:, None, None]

        def rope(z: torch.Tensor) -> torch.Tensor:
            return z * cos + torch.cat([-z[..., d // 2 :], z[..., : d // 2]], -1) * sin

        q, k = rope(q), rope(k)
    k = k.repeat_interleave(nq // nkv, dim=2)
    v = v.repeat_interleave(nq // nkv, dim=2)
    scores = torch.einsum("tbhd,sbhd->bhts", q, k) / math.sqrt(d)
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    ctx = torch.einsum("bhts,sbhd->tbhd", scores.softmax(-1), v).reshape(t, b, nq * d)
    return proj("o", ctx, arch.linear_bias)


def build(family: str, layout: str):
    arch = arch_from_hf_config(TINY_CONFIGS[family])
    cfg = transformer_config(arch, tp=1, pp=1)
    block = FactoredSelfAttention(
        cfg, factored_attention_submodules(Layout.parse(layout).factor_classes), layer_number=1,
        pg_collection=types.SimpleNamespace(tp=TPView(0, 1), cp=OneRankGroup()), ranks=RANKS,
    )
    w = factors(arch, torch.Generator().manual_seed(3))
    load(block, w, arch)
    return arch, block, w, None if family == "opt" else rotary_freqs(arch, PREFILL + DECODE)


def rotary_freqs(arch, length: int) -> torch.Tensor:
    """The angles ``GPTModel`` hands its layers: ``[length, 1, 1, d]``, position × frequency,
    the half-dimension frequencies repeated (Megatron's ``RotaryEmbedding.get_emb``, which
    places them on CUDA, so it is not called on this CPU-only machine)."""
    d = arch.head_dim
    inv = 1.0 / arch.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv)
    return torch.cat([angles, angles], dim=-1)[:, None, None, :]


def run(block, x, rope, context) -> torch.Tensor:
    """Prefill the first tokens, then one token per step, as the generation loop does."""
    outs = []
    for lo, hi in [(0, PREFILL)] + [(p, p + 1) for p in range(PREFILL, PREFILL + DECODE)]:
        out, bias = block(x[lo:hi], None, inference_context=context, rotary_pos_emb=rope)
        outs.append(out if bias is None else out + bias)
        context.sequence_len_offset += hi - lo
    return torch.cat(outs)


@pytest.mark.parametrize("family", ["llama", "qwen2", "opt"])
@pytest.mark.parametrize(
    "layout, cache, absorb",
    [("deinfer", "full", False), ("deinfer", "latent", False), ("deinfer", "latent", True),
     ("naive", "full", False)],
)
def test_prefill_and_decode_match_the_reference(family, layout, cache, absorb, monkeypatch) -> None:
    arch, block, w, rope = build(family, layout)
    x = torch.randn(PREFILL + DECODE, BATCH, arch.hidden_size, generator=torch.Generator().manual_seed(5))
    absorbed = []  # one entry per call of U_v's absorption (only ShardedUp has one)
    per_unit = getattr(block.linear_v_up, "per_unit", None)
    if per_unit is not None:
        monkeypatch.setattr(block.linear_v_up, "per_unit", lambda *a: absorbed.append(1) or per_unit(*a))
    context = StaticInferenceContext(BATCH, PREFILL + DECODE)
    context.kv_cache, context.absorb_values = CacheKind(cache), absorb

    with torch.no_grad():
        got = run(block, x, rope, context)
    want = reference(x, w, arch)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=TOL)

    stored = context.key_value_memory_dict[1]
    if cache == "latent":
        assert isinstance(stored, LatentKVCache)
        assert (stored.a.shape[-1], stored.b.shape[-1]) == (RANKS.k, RANKS.v)
    else:
        assert isinstance(stored, FullKVCache) and stored.a.shape[-2] == arch.num_kv_heads
    assert len(absorbed) == (DECODE if absorb else 0), "value absorption runs on decode steps only"


def test_without_a_cache_the_whole_sequence_matches() -> None:
    arch, block, w, rope = build("qwen2", "deinfer")
    x = torch.randn(PREFILL, BATCH, arch.hidden_size, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        out, _ = block(x, None, rotary_pos_emb=rope)
    torch.testing.assert_close(out.double(), reference(x, w, arch), rtol=0, atol=TOL)


def test_latent_cache_needs_whole_latents() -> None:
    arch, block, _, rope = build("llama", "naive")
    context = StaticInferenceContext(BATCH, PREFILL)
    context.kv_cache = CacheKind.LATENT
    x = torch.randn(PREFILL, BATCH, arch.hidden_size)
    with pytest.raises(ValueError, match="latent KV cache needs whole latents"):
        block(x, None, inference_context=context, rotary_pos_emb=rope)


@pytest.mark.parametrize(
    "keywords, message",
    [
        (dict(attn_mask_type=AttnMaskType.no_mask), "attn_mask_type .* is not supported"),
        (dict(attention_type="cross"), "attention_type 'cross' is not supported"),
        (dict(attention_dropout=0.1), "attention_dropout 0.1 is not supported"),
        (dict(cp_comm_type="p2p"), "context parallelism .* use context_parallel_size=1"),
    ],
)
def test_core_attention_refuses_what_megatron_may_ask_but_it_cannot_do(keywords, message) -> None:
    config = types.SimpleNamespace(softmax_scale=None)
    with pytest.raises(ValueError, match=message):
        SdpaCoreAttention(config, layer_number=1, num_heads=4, num_kv_heads=2, head_dim=8, **keywords)
    assert SdpaCoreAttention(config, num_heads=4, num_kv_heads=2, head_dim=8, softmax_scale=0.5).scale == 0.5


@pytest.mark.parametrize("heads, kv_heads, dv", [(8, 2, 8), (6, 6, 8), (4, 1, 5)])
@pytest.mark.parametrize("padded", [False, True])
def test_a_single_query_attends_as_every_head_on_its_own(heads, kv_heads, dv, padded) -> None:
    """A decode step's query against its cached keys (the grouped path: the heads of a KV group
    as one block), against attention written out per head in float64 — with a padding mask
    that hides different keys per sequence (Megatron's ``[b, 1, 1, sk]``, True = masked) and
    values of another width than the keys (value absorption's latents)."""
    b, sk, d = 3, 11, 8
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(1, b, heads, d, generator=gen)
    k = torch.randn(sk, b, kv_heads, d, generator=gen)
    v = torch.randn(sk, b, kv_heads, dv, generator=gen)
    mask = None
    if padded:
        mask = torch.zeros(b, 1, 1, sk, dtype=torch.bool)
        mask[0, ..., :4] = True
        mask[2, ..., 7:9] = True
    config = types.SimpleNamespace(softmax_scale=None)
    got = SdpaCoreAttention(config, num_heads=heads, num_kv_heads=kv_heads, head_dim=d).attend(q, k, v, mask)
    want = torch.empty(1, b, heads, dv, dtype=torch.float64)
    for s in range(b):
        for h in range(heads):
            g = h // (heads // kv_heads)
            scores = k[:, s, g].double() @ q[0, s, h].double() / math.sqrt(d)
            if mask is not None:
                scores = scores.masked_fill(mask[s, 0, 0], float("-inf"))
            want[0, s, h] = scores.softmax(0) @ v[:, s, g].double()
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)

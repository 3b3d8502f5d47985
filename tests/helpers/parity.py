"""Checks run inside each spawned rank: build every layout of every tiny model, compare logits
with the multiplied-out Hugging Face reference, and record the collectives per layer."""

from __future__ import annotations

from typing import Any

import torch

from deinfer_megatron.specs.layout import Layout
from tests.helpers.tiny_models import decompose_randomly, mixed_ranks, random_hf_model

DECOMPOSED_LAYERS = [0, 2, 3]  # layer 1 stays dense: mixed models are the normal case


def parity_worker(tp: int, pp: int, families: list[str], layouts: list[str]) -> dict[str, Any]:
    from deinfer_megatron.arch.model import arch_from_hf_config
    from deinfer_megatron.models.build import build_stage, load_weights
    from deinfer_megatron.models.pipeline import stage_forward
    from deinfer_megatron.parallel import comm
    from deinfer_megatron.parallel.runtime import init_parallel, shutdown
    from deinfer_megatron.specs.rank_config import RankConfig

    groups = init_parallel(tp, pp)
    out: dict[str, Any] = {"tp_rank": groups.tp_rank, "pp_rank": groups.pp_rank, "results": {}}
    try:
        for family in families:
            hf = random_hf_model(family)
            ranks = mixed_ranks(hf, DECOMPOSED_LAYERS)
            kv_heads = hf.config.num_key_value_heads if family != "opt" else hf.config.num_attention_heads
            if kv_heads < tp:
                # Fewer KV heads than ranks: only decomposed attention replicates KV heads, so
                # every attention block is decomposed and the dense layout is skipped.
                ranks.update(
                    (n, r) for n, r in mixed_ranks(hf, list(range(hf.config.num_hidden_layers))).items()
                    if ".self_attn." in n
                )
            state = decompose_randomly(hf, ranks)
            arch = arch_from_hf_config(hf.config.to_dict())
            rank_config = RankConfig.from_mapping(ranks, arch)
            gen = torch.Generator().manual_seed(7)
            ids = torch.randint(0, arch.vocab_size, (2, 13), generator=gen)
            pos = torch.arange(13).unsqueeze(0).expand(2, -1)
            with torch.no_grad():
                ref = hf(ids).logits
            for layout in layouts:
                if layout == "dense" and kv_heads < tp:
                    continue
                stage = build_stage(arch, rank_config, Layout(layout), groups)
                load_weights(stage, state, rank_config)
                with comm.recording() as ledger:
                    logits = stage_forward(stage, ids, pos)
                    logits = None if logits is None else logits.cpu()  # the reference runs on the CPU
                entry: dict[str, Any] = {
                    "ranks": ranks,
                    "collectives": [
                        (r.layer, r.kind, r.elements_per_token, r.tokens) for r in ledger.records
                    ],
                    "params": {n: p.numel() for n, p in stage.model.named_parameters()},
                    "layer_offset": stage.layer_offset,
                }
                if logits is not None:
                    entry["max_abs_diff"] = (logits - ref).abs().max().item()
                    entry["logit_scale"] = ref.abs().max().item()
                    entry["greedy_equal"] = bool((logits.argmax(-1) == ref.argmax(-1)).all())
                out["results"][f"{family}/{layout}"] = entry
    finally:
        shutdown()
    return out

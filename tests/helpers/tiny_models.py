"""Tiny Hugging Face models with random low-rank factors, and their dense references.

The reference for every parity test is an ordinary Hugging Face model whose decomposed
matrices are replaced by ``U @ V`` multiplied out — computed in one process by transformers,
independently of anything in deinfer_megatron.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(
        model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, vocab_size=101, max_position_embeddings=128,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu",
    ),
    "qwen2": dict(
        model_type="qwen2", hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, vocab_size=97, max_position_embeddings=128,
        rms_norm_eps=1e-6, rope_theta=100000.0, tie_word_embeddings=True, hidden_act="silu",
        use_sliding_window=False,
    ),
    "opt": dict(
        model_type="opt", hidden_size=64, ffn_dim=96, num_hidden_layers=4, num_attention_heads=4,
        vocab_size=99, max_position_embeddings=128, word_embed_proj_dim=64,
        do_layer_norm_before=True, activation_function="relu", tie_word_embeddings=True,
        enable_bias=True, dropout=0.0, attention_dropout=0.0,
    ),
}


def hf_config(family: str, **overrides: Any) -> transformers.PretrainedConfig:
    kw = {**TINY_CONFIGS[family], **overrides}
    kw.pop("model_type")
    return transformers.AutoConfig.for_model(family, **kw)


def random_hf_model(family: str, seed: int = 0, **overrides: Any) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    cfg = hf_config(family, **overrides)
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    with torch.no_grad():  # non-trivial norms and biases so that mistakes show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.05 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    return model.eval()


def decompose_randomly(
    model: transformers.PreTrainedModel, ranks: dict[str, int], seed: int = 1
) -> dict[str, torch.Tensor]:
    """Replace each module in ``ranks`` by random factors (u, v) and write ``W = U·V`` into the
    Hugging Face model so it becomes the dense reference. Returns the decomposed state dict
    (``<module>.u``/``<module>.v`` instead of ``<module>.weight``; biases kept)."""
    gen = torch.Generator().manual_seed(seed)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    modules = dict(model.named_modules())
    for name, r in ranks.items():
        w = modules[name].weight
        out_f, in_f = w.shape
        u = torch.randn(out_f, r, generator=gen) / r**0.5 * 0.3
        v = torch.randn(r, in_f, generator=gen) / in_f**0.5 * 3.0
        with torch.no_grad():
            w.copy_(u @ v)
        del state[f"{name}.weight"]
        state[f"{name}.u"], state[f"{name}.v"] = u, v
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def mixed_ranks(model: transformers.PreTrainedModel, layers: list[int], seed: int = 2) -> dict[str, int]:
    """Variadic ranks (q, k, v, o; gate, up, down all differ) for the given layers."""
    gen = torch.Generator().manual_seed(seed)
    prefix = "model.decoder.layers" if model.config.model_type == "opt" else "model.layers"
    out = {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or not name.startswith(prefix):
            continue
        if int(name.split(".")[len(prefix.split("."))]) in layers:
            hi = min(module.weight.shape)
            out[name] = int(torch.randint(max(1, hi // 4), hi, (1,), generator=gen))
    return out


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def smollm2_dir():
    """The converted embedded SmolLM2 folder (cached after the first conversion)."""
    from deinfer_megatron.checkpoints.embedded import fetch_model

    return fetch_model("smollm2-135m")


def save_tiny_folder(family: str, path, seed: int = 0, **overrides: Any):
    """A tiny random Hugging Face model folder that shares SmolLM2's tokenizer (so that text
    can be fed to it); returns the model (eval mode, float32)."""
    import shutil
    from pathlib import Path

    src = smollm2_dir()
    tok = {"vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2}
    model = random_hf_model(family, seed=seed, **{**tok, **overrides})
    model.save_pretrained(path, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (Path(src) / name).is_file():
            shutil.copy2(Path(src) / name, Path(path) / name)
    return model


def full_ranks(model: transformers.PreTrainedModel) -> dict[str, int]:
    """Every decoder linear at rank min(out, in): a lossless decomposition."""
    prefix = "model.decoder.layers" if model.config.model_type == "opt" else "model.layers"
    return {n: min(m.weight.shape) for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and n.startswith(prefix)}


def full_rank_folders(root, family: str = "llama", dense_attention: tuple[int, ...] = (), **overrides: Any):
    """A tiny dense folder ``root/dense`` and its lossless (full-rank, plain SVD) decomposition
    ``root/dec``, written by the project's own ``decompose``; returns ``(hf_model, dense, dec)``.
    The attention blocks of the layers in ``dense_attention`` stay dense, as an allocation that
    finds a block's factors no smaller than its matrices leaves them."""
    import json
    from pathlib import Path

    from deinfer_megatron.decompose.job import DecomposeJob, run_decompose

    root = Path(root)
    hf = save_tiny_folder(family, root / "dense", **overrides)
    dense = tuple(f"layers.{i}.self_attn." for i in dense_attention)
    ranks = {name: r for name, r in full_ranks(hf).items() if not any(d in name for d in dense)}
    (root / "ranks.json").write_text(json.dumps(ranks))
    dec = run_decompose(DecomposeJob(root / "dense", "svd", rank_config=root / "ranks.json", out=root / "dec"))
    return hf, root / "dense", dec


def hf_greedy_texts(model: transformers.PreTrainedModel, folder: Any, prompts: list[str], new: int) -> list[list[int]]:
    """transformers' greedy ``new`` tokens after each text prompt, tokenised by ``folder``'s
    tokenizer (special tokens as the tokenizer adds them, no stop token): what ``generate
    --prompt`` must print for a lossless folder of ``model``."""
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    out = []
    for prompt in prompts:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            tokens = model.generate(ids, max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
        out.append(tokens[0, ids.shape[1]:].tolist())
    return out


def hf_greedy_alone(model: transformers.PreTrainedModel, prompt: list[int], new: int, eos: int) -> list[int]:
    """transformers' greedy continuation of one prompt (no padding, no batch), cut after the
    first ``eos`` (kept): the reference for the project's own sampling loop."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=transformers.GenerationConfig(
        do_sample=False, max_new_tokens=new, eos_token_id=None, pad_token_id=0))[0, len(prompt):].tolist()
    return out[: out.index(eos) + 1] if eos in out else out

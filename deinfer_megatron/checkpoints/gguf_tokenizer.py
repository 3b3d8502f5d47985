"""Rebuild a Hugging Face fast tokenizer from GGUF ``tokenizer.*`` metadata.

A GGUF file carries the whole tokenizer (vocabulary, merges, token types, special ids, chat
template) as metadata, but not the *pre-tokenizer*: llama.cpp only stores its name
(``tokenizer.ggml.pre``) and hard-codes the split rules. This module turns that metadata back into
``tokenizer.json`` (built with the ``tokenizers`` library) plus ``tokenizer_config.json`` and
``special_tokens_map.json`` so that ``transformers.AutoTokenizer.from_pretrained(folder)`` works
offline and encodes exactly as llama.cpp (and the original Hugging Face tokenizer) does.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

# llama.cpp token types (enum llama_token_type / gguf.TokenType).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# llama.cpp pre-tokenizer name -> does it isolate every digit (its "\p{N}" rule) before the
# GPT-2 regex?  SmolLM/StarCoder/Refact split digits one by one; plain GPT-2 does not. The
# HF equivalent of "\p{N}" first is `Digits(individual_digits=True)` before `ByteLevel`.
_PRE_TOKENIZERS: dict[str, bool] = {
    "smollm": True,
    "starcoder": True,
    "refact": True,
    "gpt-2": False,
    "gpt2": False,
}


def _special_id(meta: dict[str, Any], key: str) -> int | None:
    value = meta.get(f"tokenizer.ggml.{key}_token_id")
    return None if value is None else int(value)


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """Build a byte-level BPE ``tokenizers.Tokenizer`` from GGUF metadata.

    Only ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE) is supported, because that is the
    only scheme whose merges and byte alphabet GGUF stores verbatim in HF form ("Ġ" for space).
    """
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {model!r}; supported: 'gpt2' (byte-level BPE)")
    pre = meta.get("tokenizer.ggml.pre", "gpt-2")
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}; supported: {sorted(_PRE_TOKENIZERS)}")

    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("GGUF vocabulary has duplicate tokens; cannot build a BPE vocab from it")
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if _PRE_TOKENIZERS[pre]:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()

    # Control tokens are "special" (skipped by decode(skip_special_tokens=True)); user-defined
    # ones are matched verbatim but kept in decoded text. Neither goes through BPE.
    added = [
        AddedToken(tokens[i], special=(t == _TOKEN_TYPE_CONTROL), normalized=False)
        for i, t in enumerate(types)
        if t in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)
    ]
    tok.add_tokens(added)  # ids are already in the vocab, so they keep their GGUF ids

    bos, eos = _special_id(meta, "bos"), _special_id(meta, "eos")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        pre_ids = [(tokens[bos], bos)] if add_bos else []
        post_ids = [(tokens[eos], eos)] if add_eos else []
        single = [t for t, _ in pre_ids] + ["$A"] + [t for t, _ in post_ids]
        pair = single + [t for t, _ in pre_ids] + ["$B"] + [t for t, _ in post_ids]
        tok.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=sorted(set(pre_ids + post_ids))
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def tokenizer_files(meta: dict[str, Any], context_length: int) -> dict[str, Any]:
    """Return ``{file name: content}`` for the tokenizer files of a Hugging Face folder.

    ``tokenizer.json`` content is a string (the serialised ``tokenizers.Tokenizer``), the rest
    are JSON-able dicts. ``PreTrainedTokenizerFast`` is named as the class because it loads
    ``tokenizer.json`` as is in transformers 4.x and 5.x (model-specific classes may rebuild
    the pre-tokenizer and lose the digit split).
    """
    tok = build_tokenizer(meta)
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    special: dict[str, str] = {}
    for key in ("bos", "eos", "unk", "pad"):
        idx = _special_id(meta, "padding" if key == "pad" else ("unknown" if key == "unk" else key))
        if idx is not None:
            special[f"{key}_token"] = tokens[idx]
    types: list[int] = meta.get("tokenizer.ggml.token_type", [])
    controls = [tokens[i] for i, t in enumerate(types) if t == _TOKEN_TYPE_CONTROL]
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": bool(meta.get("tokenizer.ggml.add_space_prefix", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(context_length),
        "additional_special_tokens": [t for t in controls if t not in special.values()],
        **special,
    }
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    special_map = {**special, "additional_special_tokens": config["additional_special_tokens"]}
    return {
        "tokenizer.json": tok.to_str(pretty=False),
        "tokenizer_config.json": config,
        "special_tokens_map.json": special_map,
    }

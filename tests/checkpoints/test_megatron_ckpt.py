"""Megatron checkpoints (torch and torch_dist) read back into Hugging Face form.

Tiny LLaMA (GQA, untied) and Qwen2 (QKV bias, tied) models are loaded into dense Megatron
``GPTModel`` stages at TP=1, TP=2 and TP=1×PP=2 on real gloo ranks, and each rank writes its
checkpoint the way Megatron-LM's ``save_checkpoint`` does: ``torch.save`` of
``{"args", "checkpoint_version", "iteration", "model", "rng_state"}`` per ``mp_rank`` folder,
and ``dist_checkpointing.save`` of the model's ``sharded_state_dict()`` with the same common
state. Multi-rank checkpoints name their norms as Transformer Engine does
(``linear_qkv.layer_norm_weight``), single-rank ones as the local spec does; the PP=2 Qwen2 dist
checkpoint keys its layers one by one (``singleton_local_shards``). Reading must give back
exactly the original Hugging Face tensors and a config transformers loads with the same logits.
Layouts no dense stage of this project can build (fewer KV heads than TP ranks, uneven pipeline
stages) are written by splitting a TP=1 checkpoint as Megatron would.
"""

from __future__ import annotations

import io
import json
import multiprocessing
import random
import re
import shutil
from argparse import Namespace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from deinfer_megatron.checkpoints.megatron_ckpt import detect_megatron_checkpoint, read_megatron_checkpoint
from tests.helpers.distributed import run_ranks
from tests.helpers.tiny_models import TINY_CONFIGS, random_hf_model

FAMILIES = ("llama", "qwen2")
PARALLEL = {1: [(1, 1)], 2: [(2, 1), (1, 2)]}  # world size → (TP, PP) layouts written by one spawn
FORMATS = ("torch", "dist")


def _name(family: str, tp: int, pp: int, fmt: str) -> str:
    return f"{family}-tp{tp}-pp{pp}-{fmt}"


def _te_names(tp: int, pp: int) -> bool:
    return tp * pp > 1


def megatron_args(family: str, *, tp: int = 1, pp: int = 1, padded_vocab: int | None = None,
                  ckpt_format: str = "torch", **overrides: Any) -> Namespace:
    """The model fields of the Namespace Megatron-LM's parser and validate_args produce."""
    from megatron.core.transformer.enums import AttnBackend

    cfg = TINY_CONFIGS[family]
    heads = cfg["num_attention_heads"]
    fields = dict(
        num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
        ffn_hidden_size=cfg["intermediate_size"], num_attention_heads=heads,
        group_query_attention=True, num_query_groups=cfg["num_key_value_heads"],
        kv_channels=cfg["hidden_size"] // heads, max_position_embeddings=cfg["max_position_embeddings"],
        seq_length=64, position_embedding_type="rope", rotary_base=int(cfg["rope_theta"]),
        rotary_percent=1.0, rotary_interleaved=False, use_rope_scaling=False,
        normalization="RMSNorm", norm_epsilon=cfg["rms_norm_eps"], apply_layernorm_1p=False,
        qk_layernorm=False, swiglu=True, add_bias_linear=False, add_qkv_bias=family == "qwen2",
        untie_embeddings_and_output_weights=not cfg["tie_word_embeddings"],
        make_vocab_size_divisible_by=1, padded_vocab_size=padded_vocab or cfg["vocab_size"],
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=None, num_experts=None, multi_latent_attention=False,
        transformer_impl="transformer_engine" if _te_names(tp, pp) else "local",
        ckpt_format=ckpt_format, use_dist_ckpt=ckpt_format == "torch_dist",
        params_dtype=torch.float32, bf16=False, fp16=False, attention_backend=AttnBackend.auto,
        iteration=10, save="/checkpoints", load=None,
    )
    fields.update(overrides)
    return Namespace(**fields)


def _common(args: Namespace) -> dict[str, Any]:
    return {"args": args, "checkpoint_version": 3.0, "iteration": 10, "num_floating_point_operations_so_far": 0}


def _to_te_name(key: str) -> str:
    return key.replace("input_layernorm.", "self_attention.linear_qkv.layer_norm_").replace(
        "pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_")


def _rank_dir(tp_rank: int, pp_rank: int, pp: int) -> str:
    return f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "")


def write_torch(root: Path, args: Namespace, model_sd: dict, tp_rank: int, pp_rank: int, pp: int) -> None:
    """What Megatron-LM's save_checkpoint writes with --ckpt-format torch, for one rank."""
    state = {
        **_common(args),
        "model": model_sd,
        "rng_state": [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                       "torch_rng_state": torch.get_rng_state(), "rng_tracker_states": {}}],
    }
    path = root / "iter_0000010" / _rank_dir(tp_rank, pp_rank, pp) / "model_optim_rng.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    (root / "latest_checkpointed_iteration.txt").write_text("10")


def _save_dist(folder: Path, args: Namespace, sharded: dict, te: bool, first: bool) -> None:
    """What save_checkpoint writes with --ckpt-format torch_dist (common state → common.pt)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    if first:
        folder.mkdir(parents=True)
        (folder.parent / "latest_checkpointed_iteration.txt").write_text("10")
    dist.barrier()
    if te:
        for value in sharded.values():
            if isinstance(value, ShardedTensor):
                value.key = _to_te_name(value.key)
    # Megatron's writer syncs and allocates on CUDA: patches.megatron_cpu covers it on a CPU machine.
    dist_checkpointing.save({**_common(args), "model": sharded}, str(folder))


def write_checkpoints(layouts: list[tuple[int, int]], root: str) -> dict[str, bool]:
    """Rank body: build each family at each layout and write it in both formats. At TP=1 also
    a bfloat16 model, and a dist checkpoint read while torch.distributed is initialised."""
    from deinfer_megatron.arch.model import arch_from_hf_config
    from deinfer_megatron.models.build import build_stage, load_weights
    from deinfer_megatron.parallel.runtime import init_parallel, shutdown
    from deinfer_megatron.specs.layout import Layout
    from deinfer_megatron.specs.rank_config import RankConfig

    # Megatron's torch_dist writer forks worker processes, which a daemonic rank may not have.
    multiprocessing.current_process().daemon = False
    out = {}
    try:
        for tp, pp in layouts:
            groups = init_parallel(tp, pp)
            first = groups.tp_rank == 0 and groups.pp_rank == 0
            te = _te_names(tp, pp)
            variants = [(f, torch.float32) for f in FAMILIES] + ([("llama", torch.bfloat16)] if tp * pp == 1 else [])
            for family, dtype in variants:
                hf = random_hf_model(family)
                arch = arch_from_hf_config(hf.config.to_dict())
                stage = build_stage(arch, RankConfig.dense(arch), Layout.DENSE, groups, dtype=dtype)
                load_weights(stage, hf.state_dict(), RankConfig.dense(arch))
                tag = "-bf16" if dtype == torch.bfloat16 else ""

                sd = stage.model.state_dict_for_save_checkpoint()
                if te:  # Transformer Engine: norms fused into the linears, extra state per module
                    sd = {_to_te_name(k): io.BytesIO(b"fp8") if k.endswith("_extra_state") else v
                          for k, v in sd.items()}
                args = megatron_args(family, tp=tp, pp=pp, padded_vocab=stage.padded_vocab)
                folder = Path(root) / (_name(family, tp, pp, "torch") + tag)
                write_torch(folder, args, sd, groups.tp_rank, groups.pp_rank, pp)

                # Megatron-LM's default keys stack the layers; newer runs may key them per layer
                # with the gated fc1 in separate _w/_v halves (singleton_local_shards).
                metadata = {"singleton_local_shards": True} if pp > 1 and family == "qwen2" else None
                args = megatron_args(family, tp=tp, pp=pp, padded_vocab=stage.padded_vocab, ckpt_format="torch_dist")
                folder = Path(root) / (_name(family, tp, pp, "dist") + tag) / "iter_0000010"
                _save_dist(folder, args, stage.model.sharded_state_dict(metadata=metadata), te, first)
            if tp * pp == 1:  # a reader inside a running job: the dist load runs in a child process
                _, got = read_megatron_checkpoint(Path(root) / _name("llama", 1, 1, "dist"), vocab_size=101)
                want = random_hf_model("llama").state_dict()
                out["read_while_initialised"] = all(torch.equal(got[k], v) for k, v in want.items())
    finally:
        shutdown()
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("megatron")
    for world, layouts in PARALLEL.items():
        results = run_ranks(world, write_checkpoints, layouts, str(root), timeout=300)
        if world == 1:
            assert results[0]["read_while_initialised"]
    return root


@pytest.fixture(scope="module")
def references() -> dict[str, Any]:
    return {family: random_hf_model(family) for family in FAMILIES}


def _expected(model: Any) -> dict[str, torch.Tensor]:
    sd = model.state_dict()
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight")
    return sd


def _check_loads_in_transformers(config: dict, sd: dict, reference: Any, folder: Path) -> None:
    """The config and tensors make a Hugging Face folder with the reference's logits."""
    import transformers
    from safetensors.torch import save_file

    from deinfer_megatron.arch.model import arch_from_hf_config

    arch_from_hf_config(config)  # the project reads it too
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    save_file(sd, str(folder / "model.safetensors"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    fresh = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    tied = config["tie_word_embeddings"]  # a tied model has no lm_head.weight of its own to load
    missing, unexpected = fresh.load_state_dict(sd, strict=not tied)
    assert not unexpected and missing == (["lm_head.weight"] if tied else [])
    ids = torch.randint(0, config["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = reference(ids).logits
        for model in (loaded, fresh):
            diff = (model.eval()(ids).logits - want).abs().max().item()
            assert diff <= 1e-5, diff


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)], ids=lambda v: str(v))
@pytest.mark.parametrize("family", FAMILIES)
def test_reads_back_the_hugging_face_model(checkpoints, references, tmp_path, family, tp, pp, fmt) -> None:
    root = checkpoints / _name(family, tp, pp, fmt)
    assert detect_megatron_checkpoint(root) == fmt
    assert detect_megatron_checkpoint(root / "iter_0000010") == fmt
    reference = references[family]
    config, sd = read_megatron_checkpoint(root, vocab_size=reference.config.vocab_size)
    expected = _expected(reference)
    assert sorted(sd) == sorted(expected)
    for name, tensor in expected.items():
        assert sd[name].dtype == torch.float32 and torch.equal(sd[name], tensor), name
    assert config["model_type"] == family and config["tie_word_embeddings"] == (family == "qwen2")
    _check_loads_in_transformers(config, sd, reference, tmp_path / "hf")


def test_padded_vocabulary_is_kept_by_default(checkpoints, references) -> None:
    config, sd = read_megatron_checkpoint(checkpoints / _name("qwen2", 2, 1, "dist") / "iter_0000010")
    assert config["vocab_size"] == 98 and sd["model.embed_tokens.weight"].shape[0] == 98
    assert torch.equal(sd["model.embed_tokens.weight"][:97], references["qwen2"].model.embed_tokens.weight)
    assert not sd["model.embed_tokens.weight"][97:].any()


def _split_tp(sd: dict[str, torch.Tensor], tp: int) -> list[dict[str, torch.Tensor]]:
    """Megatron's TP layout written out independently: QKV rows (a plain column split, so with
    fewer query groups than ranks a rank holds part of a group), [gate_r; up_r] per rank."""
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    for key, t in sd.items():
        if not isinstance(t, torch.Tensor):  # local modules' (empty) _extra_state
            parts = [t] * tp
        elif key.endswith(("linear_qkv.weight", "linear_qkv.bias", "word_embeddings.weight", "output_layer.weight")):
            parts = t.chunk(tp, 0)
        elif key.endswith(("linear_proj.weight", "linear_fc2.weight")):
            parts = t.chunk(tp, 1)
        elif key.endswith("linear_fc1.weight"):
            gate, up = t.chunk(2, 0)
            parts = [torch.cat([g, u]) for g, u in zip(gate.chunk(tp), up.chunk(tp))]
        else:
            parts = [t] * tp
        for shard, part in zip(shards, parts):
            shard[key] = part.clone() if isinstance(part, torch.Tensor) else part
    return shards


def test_bfloat16_checkpoints_agree_across_formats(checkpoints, references) -> None:
    _, from_torch = read_megatron_checkpoint(checkpoints / (_name("llama", 1, 1, "torch") + "-bf16"), vocab_size=101)
    _, from_dist = read_megatron_checkpoint(checkpoints / (_name("llama", 1, 1, "dist") + "-bf16"), vocab_size=101)
    assert sorted(from_torch) == sorted(from_dist)
    assert all(t.dtype == torch.float32 and torch.equal(t, from_dist[k]) for k, t in from_torch.items())
    q = references["llama"].model.layers[0].self_attn.q_proj.weight
    assert torch.equal(from_torch["model.layers.0.self_attn.q_proj.weight"], q.bfloat16().float())


def test_fewer_query_groups_than_tp_ranks_and_uneven_stages(checkpoints, references, tmp_path) -> None:
    """Qwen2 has 2 KV heads; at TP=4 Megatron splits the fused QKV rows plainly over 4 ranks.
    The two pipeline stages hold 1 and 3 layers, each numbered from 0."""
    folder = checkpoints / _name("qwen2", 1, 1, "torch") / "iter_0000010"
    source = torch.load(folder / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    sd = dict(source["model"])
    sd["embedding.word_embeddings.weight"] = torch.cat([sd["embedding.word_embeddings.weight"], torch.zeros(3, 64)])
    stages = [{k: v for k, v in sd.items() if k.startswith(("embedding.", "decoder.layers.0."))}, {}]
    for key, value in sd.items():
        m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", key)
        if m and int(m.group(1)) > 0:
            stages[1][f"decoder.layers.{int(m.group(1)) - 1}.{m.group(2)}"] = value
    stages[1]["decoder.final_layernorm.weight"] = sd["decoder.final_layernorm.weight"]
    stages[1]["output_layer.weight"] = sd["embedding.word_embeddings.weight"]  # the tied copy
    args = megatron_args("qwen2", tp=4, pp=2, padded_vocab=100, decoder_first_pipeline_num_layers=1)
    for pp_rank, stage in enumerate(stages):
        for tp_rank, shard in enumerate(_split_tp(stage, 4)):
            write_torch(tmp_path / "ckpt", args, shard, tp_rank, pp_rank, 2)
    config, got = read_megatron_checkpoint(tmp_path / "ckpt", vocab_size=97)
    expected = _expected(references["qwen2"])
    assert sorted(got) == sorted(expected)
    assert all(torch.equal(got[k], v) for k, v in expected.items())


def _tiny_torch_checkpoint(root: Path, args: Namespace, **state: Any) -> Path:
    path = root / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt"
    path.parent.mkdir(parents=True)
    torch.save({**_common(args), "model": {}, **state}, path)
    (root / "latest_checkpointed_iteration.txt").write_text("1")
    return root


@pytest.mark.parametrize("override,message", [
    (dict(swiglu=False), "SwiGLU"),
    (dict(normalization="LayerNorm"), "normalization=LayerNorm"),
    (dict(position_embedding_type="learned_absolute"), "position_embedding_type=learned_absolute"),
    (dict(add_bias_linear=True), "biases on linear layers"),
    (dict(num_experts=8), "MoE"),
    (dict(rotary_percent=0.5), "partial RoPE"),
])
def test_unsupported_architectures_are_one_line_errors(tmp_path, override, message) -> None:
    root = _tiny_torch_checkpoint(tmp_path, megatron_args("llama", **override))
    with pytest.raises(ValueError, match=message) as err:
        read_megatron_checkpoint(root)
    assert "\n" not in str(err.value) and "supported: LLaMA/Qwen2-style" in str(err.value)


def test_virtual_pipeline_is_rejected(tmp_path) -> None:
    root = _tiny_torch_checkpoint(tmp_path / "a", megatron_args("llama", pp=1, virtual_pipeline_model_parallel_size=2))
    with pytest.raises(ValueError, match="virtual pipeline"):
        read_megatron_checkpoint(root)
    path = tmp_path / "b" / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt"
    path.parent.mkdir(parents=True)
    torch.save({**_common(megatron_args("llama")), "model0": {}, "model1": {}}, path)
    with pytest.raises(ValueError, match="virtual pipeline.*torch_dist"):
        read_megatron_checkpoint(path.parent.parent)


def test_a_folder_that_is_not_a_checkpoint(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert detect_megatron_checkpoint(tmp_path) is None
    with pytest.raises(FileNotFoundError, match="not a Megatron checkpoint"):
        read_megatron_checkpoint(tmp_path)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("20")
    with pytest.raises(FileNotFoundError, match="iter_0000020, which does not exist"):
        read_megatron_checkpoint(tmp_path)


def test_missing_rank_file(tmp_path) -> None:
    args = megatron_args("llama", tp=2)
    write_torch(tmp_path, args, {}, 0, 0, 1)
    with pytest.raises(FileNotFoundError, match="mp_rank_01"):
        read_megatron_checkpoint(tmp_path)


def test_release_checkpoints_are_found(tmp_path) -> None:
    path = tmp_path / "release" / "mp_rank_00" / "model_optim_rng.pt"
    path.parent.mkdir(parents=True)
    torch.save({**_common(megatron_args("llama")), "model": {}}, path)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release")
    assert detect_megatron_checkpoint(tmp_path) == "torch"
    assert detect_megatron_checkpoint(tmp_path / "release") == "torch"


def test_args_that_contradict_the_tensors(checkpoints, tmp_path) -> None:
    folder = checkpoints / _name("llama", 1, 1, "torch") / "iter_0000010"
    model = torch.load(folder / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)["model"]
    write_torch(tmp_path / "torch", megatron_args("llama", num_query_groups=8), model, 0, 0, 1)
    with pytest.raises(ValueError, match="linear_qkv.weight' has 128 rows but the args imply 192"):
        read_megatron_checkpoint(tmp_path / "torch")
    dist_copy = shutil.copytree(checkpoints / _name("llama", 1, 1, "dist"), tmp_path / "dist")
    torch.save(_common(megatron_args("llama", ffn_hidden_size=64)), dist_copy / "iter_0000010" / "common.pt")
    with pytest.raises(ValueError, match="linear_fc2.weight' has shape .* its args imply"):
        read_megatron_checkpoint(dist_copy)


def test_a_megatron_checkpoint_goes_straight_to_a_served_decomposed_model(checkpoints, references, tmp_path) -> None:
    """decompose reads the TP=2 torch checkpoint (with a tokenizer folder), and the decomposed
    folder serves the reference model's logits (full rank: lossless)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from deinfer_megatron.arch.model import arch_from_hf_config
    from deinfer_megatron.decompose.job import DecomposeJob, run_decompose
    from tests.helpers.stage import stage_logits

    reference = references["llama"]
    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, reference.config.vocab_size)}}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
                            unk_token="<unk>").save_pretrained(tmp_path / "tok")
    arch = arch_from_hf_config(reference.config.to_dict())
    (tmp_path / "full.json").write_text(json.dumps({n: min(s) for n, s in arch.linear_shapes().items()}))
    source = checkpoints / _name("llama", 2, 1, "torch")
    with pytest.raises(ValueError, match="pass --tokenizer DIR"):
        run_decompose(DecomposeJob(source, "svd", ratio=0.5))
    out = run_decompose(DecomposeJob(source, "svd", rank_config=tmp_path / "full.json",
                                     tokenizer=tmp_path / "tok", out=tmp_path / "dec"))
    ids = torch.randint(0, reference.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference(ids).logits
    got = stage_logits(out, ids, layout="deinfer")
    assert (got - want).abs().max().item() <= 1e-4 * max(1.0, want.abs().max().item())
    assert (out / "tokenizer.json").is_file()

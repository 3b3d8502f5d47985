"""A decomposed model as a Megatron user builds it: ``TransformerConfig``, our block spec,
Megatron's own ``GPTModel`` and process groups, then a forward pass.

    python examples/megatron_api.py                      # random factors, synthetic llama-tiny
    python examples/megatron_api.py --model DIR          # a folder from `deinfer-megatron decompose`
    python examples/megatron_api.py --save-logits out.pt # also save input ids and logits

It runs in one process (a gloo world of one rank, on the CPU). The only pieces of
deinfer_megatron used are the ones a Megatron program needs: the architecture description, the
rank config, the decoder-block spec and the checkpoint loader. ``deinfer-megatron generate``
does the same through ``models.build.load_folder``, on as many ranks as ``--tp × --pp``.
tests/test_examples.py runs this file and compares its logits with a Hugging Face model whose
factors are multiplied out.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist

from deinfer_megatron import patches
from deinfer_megatron.arch.model import ModelArch, transformer_config
from deinfer_megatron.checkpoints.loader import load_stage
from deinfer_megatron.specs.builder import decomposed_block_spec
from deinfer_megatron.specs.layout import Layout
from deinfer_megatron.specs.rank_config import RankConfig

SYNTHETIC = "llama-tiny"  # 4 layers, hidden 64, 8 heads / 4 KV heads, vocabulary 256
# Variadic ranks: every projection its own rank, layers 0-2 decomposed, layer 3 left dense.
SYNTHETIC_RANKS = {"self_attn.q_proj": 24, "self_attn.k_proj": 12, "self_attn.v_proj": 14,
                   "self_attn.o_proj": 20, "mlp.gate_proj": 30, "mlp.up_proj": 28, "mlp.down_proj": 26}
SYNTHETIC_LAYERS = (0, 1, 2)


def synthetic_source(seed: int = 0) -> tuple[ModelArch, RankConfig, Mapping[str, torch.Tensor]]:
    """A LLaMA-shaped model with random factors, as Hugging Face-named tensors (``.u``/``.v``)."""
    from deinfer_megatron.models.synthetic import random_state, synthetic_arch

    arch = synthetic_arch(SYNTHETIC)
    ranks = {f"model.layers.{i}.{name}": r for i in SYNTHETIC_LAYERS for name, r in SYNTHETIC_RANKS.items()}
    return arch, RankConfig.from_mapping(ranks, arch), random_state(arch, ranks, seed=seed)


def folder_source(path: Path) -> tuple[ModelArch, RankConfig, Mapping[str, torch.Tensor]]:
    """A decomposed (or dense) model folder, its manifest verified; tensors are read lazily."""
    from deinfer_megatron.checkpoints.folder import open_model

    folder = open_model(path)
    return folder.arch, folder.rank_config, folder.source


def init_process_groups() -> Any:
    """Megatron's process groups for a world of one rank (gloo, no network).

    A Megatron program that already called ``initialize_model_parallel`` passes its own
    ``ProcessGroupCollection`` instead. ``patches.apply_all()`` installs the CPU shims Megatron
    needs without CUDA (it patches nothing on a GPU machine).
    """
    patches.apply_all()
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    return ProcessGroupCollection.use_mpu_process_groups()


def build_model(arch: ModelArch, rank_config: RankConfig, pgs: Any, layout: str = "deinfer") -> Any:
    """Megatron's ``GPTModel`` with the decomposed decoder block, built on the meta device and
    given empty CPU storage (the checkpoint fills it; only this rank's shards are allocated)."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    config = transformer_config(arch, tp=1, pp=1)  # a megatron.core TransformerConfig
    block_spec = decomposed_block_spec(config, rank_config, Layout(layout))
    with torch.device("meta"):
        model = GPTModel(
            config,
            block_spec,
            vocab_size=arch.vocab_size,  # Megatron needs a multiple of TP: pad it when TP > 1
            max_sequence_length=arch.max_positions,
            parallel_output=False,
            share_embeddings_and_output_weights=arch.tied_embeddings,
            position_embedding_type="learned_absolute" if arch.family == "opt" else "rope",
            rotary_base=arch.rope_theta if arch.family != "opt" else 10000,
            pg_collection=pgs,
        )
    model.to_empty(device="cpu")
    return model.eval().requires_grad_(False)


def forward(model: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits ``[b, s, vocab]`` of a causal forward over ``input_ids [b, s]``."""
    positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    with torch.inference_mode():
        return model(input_ids, positions, None, runtime_gather_output=True)


def main(argv: list[str] | None = None) -> torch.Tensor:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="model folder (default: random factors, synthetic llama-tiny)")
    # (the dense layout multiplies the factors out at load time: models.build.load_weights)
    parser.add_argument("--layout", default="deinfer", choices=("deinfer", "naive"))
    parser.add_argument("--save-logits", type=Path, help="torch.save {'input_ids', 'logits'} to this file")
    args = parser.parse_args(argv)
    # Megatron-Core warns at import time about GPU packages a CPU machine lacks (Apex, TE).
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron(\.|$)")

    arch, rank_config, source = folder_source(args.model) if args.model else synthetic_source()
    pgs = init_process_groups()
    try:
        model = build_model(arch, rank_config, pgs, args.layout)
        load_stage(model, source, arch, rank_config, layer_offset=0, num_local_layers=arch.num_layers)
        input_ids = torch.randint(0, arch.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
        logits = forward(model, input_ids)
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    decomposed = sum(layer.decomposed for layer in rank_config.layers)
    print(f"{arch.family}: {decomposed} of {arch.num_layers} layers decomposed, layout {args.layout}; "
          f"logits {tuple(logits.shape)}, greedy next tokens {logits[:, -1].argmax(-1).tolist()}")
    if args.save_logits:
        torch.save({"input_ids": input_ids, "logits": logits}, args.save_logits)
    return logits


if __name__ == "__main__":
    main()

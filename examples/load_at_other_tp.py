"""A Megatron dist checkpoint of a decomposed model, saved at one TP size and loaded at another.

    python examples/load_at_other_tp.py                          # save at TP=2, load at TP=1
    python examples/load_at_other_tp.py --save-tp 1 --load-tp 4 --layout naive
    python examples/load_at_other_tp.py --save-logits out.pt     # also save ids, logits, tokens

Two phases, each a gloo world of its own on this machine (``torch.multiprocessing``): ``--save-tp``
ranks build Megatron's ``GPTModel`` from our block spec, fill it with random variadic factors
and call Megatron's own ``dist_checkpointing.save`` on ``model.sharded_state_dict()``; then
``--load-tp`` ranks build the model again — under ``--layout``, which need not be the one it was
saved under — call ``dist_checkpointing.load`` and ``model.load_state_dict``, and generate
greedily. Each rank reads only its own slices of the checkpoint's global tensors.

The one thing a decomposed model asks of Megatron's checkpointing: per-layer keys
(``metadata={"non_homogeneous_layers": True}``, Megatron-LM's ``--hetereogenous-dist-checkpoint``),
because every layer has ranks of its own. ``deinfer-megatron convert --to megatron`` writes the
same kind of checkpoint from a model folder. tests/test_examples.py runs this file and compares
its tokens and logits with a Hugging Face model whose factors are multiplied out.
"""

from __future__ import annotations

import argparse
import socket
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deinfer_megatron.specs.layout import Layout

SYNTHETIC = "llama-tiny"  # 4 layers, hidden 64, 8 heads / 4 KV heads, vocabulary 256
RANKS = {"self_attn.q_proj": 22, "self_attn.k_proj": 13, "self_attn.v_proj": 11, "self_attn.o_proj": 19,
         "mlp.gate_proj": 29, "mlp.up_proj": 27, "mlp.down_proj": 25}  # layers 0-2; layer 3 dense
METADATA = {"non_homogeneous_layers": True}  # per-layer keys: every layer has its own ranks


def synthetic_model(seed: int = 0) -> tuple[Any, Any, dict[str, torch.Tensor]]:
    """(arch, rank config, Hugging Face-named tensors with ``.u``/``.v`` factors)."""
    from deinfer_megatron.models.synthetic import random_state, synthetic_arch
    from deinfer_megatron.specs.rank_config import RankConfig

    arch = synthetic_arch(SYNTHETIC)
    ranks = {f"model.layers.{i}.{name}": r for i in range(3) for name, r in RANKS.items()}
    return arch, RankConfig.from_mapping(ranks, arch), random_state(arch, ranks, seed=seed)


def build(arch: Any, rank_config: Any, tp: int, layout: str) -> Any:
    """Megatron's ``GPTModel`` with the decomposed decoder block, this rank's shards only."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.process_groups_config import ProcessGroupCollection

    from deinfer_megatron.arch.model import transformer_config
    from deinfer_megatron.specs.builder import decomposed_block_spec

    config = transformer_config(arch, tp=tp, pp=1)
    with torch.device("meta"):
        model = GPTModel(config, decomposed_block_spec(config, rank_config, Layout(layout)),
                         vocab_size=-(-arch.vocab_size // tp) * tp,  # Megatron splits it evenly
                         max_sequence_length=arch.max_positions, parallel_output=False,
                         share_embeddings_and_output_weights=arch.tied_embeddings,
                         position_embedding_type="rope", rotary_base=arch.rope_theta,
                         pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    model.to_empty(device="cpu")
    return model.eval().requires_grad_(False)


def logits_of(model: Any, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.inference_mode():
        return model(ids, positions, None, runtime_gather_output=True)[..., :vocab]


def rank_main(rank: int, world: int, port: int, phase: str, folder: str, layout: str, steps: int,
              out: str | None) -> None:
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron(\.|$)")
    from megatron.core import dist_checkpointing, parallel_state

    from deinfer_megatron import patches
    from deinfer_megatron.checkpoints.loader import load_stage

    patches.apply_all()  # CPU stand-ins for Megatron's CUDA calls (nothing on a GPU machine)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    try:
        arch, rank_config, tensors = synthetic_model()
        model = build(arch, rank_config, world, layout)
        if phase == "save":
            load_stage(model, tensors, arch, rank_config, layer_offset=0, num_local_layers=arch.num_layers)
            dist_checkpointing.save({"model": model.sharded_state_dict(metadata=METADATA)}, folder)
            return
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict(metadata=METADATA)}, folder)
        model.load_state_dict(loaded["model"], strict=True)
        ids = torch.randint(0, arch.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
        prompt_logits = logits_of(model, ids, arch.vocab_size)
        for _ in range(steps):  # greedy, the whole sequence each step (no KV cache: it is short)
            nxt = logits_of(model, ids, arch.vocab_size)[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
        if rank == 0:
            print(f"TP={world}, layout {layout}: greedy tokens {ids[:, -steps:].tolist()}")
            if out:
                torch.save({"input_ids": ids[:, :-steps], "logits": prompt_logits, "tokens": ids[:, -steps:]}, out)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def run_world(world: int, *args: Any) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(world, port, *args), nprocs=world, join=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--save-tp", type=int, default=2, help="tensor-parallel ranks that save")
    parser.add_argument("--load-tp", type=int, default=1, help="tensor-parallel ranks that load and generate")
    parser.add_argument("--layout", default="deinfer", choices=("deinfer", "naive"), help="layout of the load")
    parser.add_argument("--steps", type=int, default=6, help="tokens to generate")
    parser.add_argument("--checkpoint", type=Path, help="where to save it (default: a temporary folder)")
    parser.add_argument("--save-logits", type=Path, help="torch.save {'input_ids', 'logits', 'tokens'} here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.checkpoint or Path(tmp) / "checkpoint"
        folder.mkdir(parents=True, exist_ok=False)  # Megatron writes into an existing, empty folder
        run_world(args.save_tp, "save", str(folder), "deinfer", args.steps, None)
        print(f"saved at TP={args.save_tp} under deinfer: {folder}")
        run_world(args.load_tp, "load", str(folder), args.layout, args.steps,
                  str(args.save_logits) if args.save_logits else None)


if __name__ == "__main__":
    main()

"""Low-rank training in a Megatron user's own script: ``TransformerConfig``, our decomposed
block spec, Megatron's ``GPTModel`` initialised from scratch, Megatron's training schedule and
learning-rate scheduler — and the loss going down.

    python examples/train_megatron.py                                   # one rank, 30 steps
    torchrun --nproc-per-node 2 examples/train_megatron.py --tp 2       # the same at TP 2
    python examples/train_megatron.py --steps 10 --layout naive --json log.json
    python examples/train_megatron.py --save CKPT      # then Megatron's dist checkpoint of it

With ``--save DIR`` the trained model is written with Megatron's ``dist_checkpointing.save`` of
``model.sharded_state_dict()`` (DIR must not exist; every factor section is saved as one global
tensor, so the checkpoint loads at any TP size and layout), read back into a model built under
the *other* factored layout (deinfer ↔ naive), and that model's logits are compared with the
trained one's: the line ``reloaded under <layout>: max |logit difference| <x>`` is the check.

The model is the synthetic llama-tiny (4 layers; layers 0-2 decomposed with variadic ranks,
layer 3 dense). ``perform_initialization=True`` draws every factor with the slot's
``init_method`` (``config.init_method`` for q/k/v and fc1, the depth-scaled
``output_layer_init_method`` for proj and fc2), the same full factors at every TP size. The
data is a toy language every rank generates alike: each sequence counts upward by a step drawn
per sequence (modulo the vocabulary), so the next token is predictable from the previous two.
The pieces from Megatron-Core: ``GPTModel``, ``get_forward_backward_func`` (its
no-pipelining schedule; the CPU shims of ``deinfer_megatron.patches`` cover its CUDA token
counter), ``OptimizerParamScheduler`` (warm-up + cosine) and torch's AdamW, which is what
``megatron.core.optimizer`` uses without Transformer Engine or Apex. The gradient clipping is
``deinfer_megatron.training.clip_by_global_norm`` (Megatron's semantics; Megatron's own asserts
CUDA tensors). tests/test_examples.py runs this file.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from deinfer_megatron import patches
from deinfer_megatron.arch.model import transformer_config
from deinfer_megatron.models.synthetic import synthetic_arch
from deinfer_megatron.specs.builder import decomposed_block_spec
from deinfer_megatron.specs.layout import Layout
from deinfer_megatron.specs.rank_config import RankConfig
from deinfer_megatron.training import clip_by_global_norm

RANKS = {"self_attn.q_proj": 24, "self_attn.k_proj": 12, "self_attn.v_proj": 14, "self_attn.o_proj": 20,
         "mlp.gate_proj": 30, "mlp.up_proj": 28, "mlp.down_proj": 26}
BATCH, SEQ = 8, 32


def init_process_groups(tp: int) -> Any:
    """gloo ranks from torchrun's environment (or a world of one), Megatron's TP groups."""
    patches.apply_all()
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if dist.get_world_size() != tp:
        raise RuntimeError(f"--tp {tp} needs {tp} ranks, {dist.get_world_size()} were started; "
                           f"run with torchrun --nproc-per-node {tp}")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    return ProcessGroupCollection.use_mpu_process_groups()


def build_model(tp: int, layout: str, pgs: Any, seed: int) -> Any:
    """Megatron's ``GPTModel`` with the decomposed block, initialised (not loaded)."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    arch = synthetic_arch("llama-tiny")
    ranks = {f"model.layers.{i}.{name}": r for i in (0, 1, 2) for name, r in RANKS.items()}
    config = transformer_config(arch, tp=tp, pp=1)
    config.perform_initialization = True  # train from scratch: every factor drawn by its init_method
    torch.manual_seed(seed)
    return GPTModel(
        config, decomposed_block_spec(config, RankConfig.from_mapping(ranks, arch), Layout(layout)),
        vocab_size=arch.vocab_size, max_sequence_length=arch.max_positions, parallel_output=False,
        share_embeddings_and_output_weights=False, position_embedding_type="rope",
        rotary_base=arch.rope_theta, pg_collection=pgs,
    )


def toy_batch(step: int, vocab: int) -> dict[str, torch.Tensor]:
    """Sequences ``start, start+d, start+2d, ...`` (mod vocab); the same on every rank."""
    gen = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, vocab, (BATCH, 1), generator=gen)
    stride = torch.randint(1, 8, (BATCH, 1), generator=gen)
    tokens = (start + stride * torch.arange(SEQ + 1)) % vocab
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}


def forward_step(data: Any, model: Any) -> tuple[torch.Tensor, Any]:
    """Megatron's ``forward_step_func``: the model's logits and the loss function of them."""
    mb = next(data)
    positions = torch.arange(SEQ).expand(BATCH, -1)
    logits = model(mb["input_ids"], positions, None, runtime_gather_output=True)

    def loss_func(out: torch.Tensor) -> tuple[torch.Tensor, dict]:
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), mb["labels"].reshape(-1))
        return loss, {"loss": loss.detach()}

    return logits, loss_func


def train(args: argparse.Namespace) -> list[float]:
    from megatron.core import parallel_state
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func

    pgs = init_process_groups(args.tp)
    try:
        model = build_model(args.tp, args.layout, pgs, args.seed)
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
        scheduler = OptimizerParamScheduler(
            optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.lr / 10, lr_warmup_steps=3,
            lr_decay_steps=args.steps, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
            wd_incr_steps=args.steps, wd_incr_style="constant")
        schedule = get_forward_backward_func()
        losses = []
        for step in range(args.steps):
            optimizer.zero_grad(set_to_none=True)
            batch = toy_batch(step, model.vocab_size)
            out = schedule(forward_step_func=forward_step, data_iterator=iter([batch]),
                           model=model, num_microbatches=1, seq_length=SEQ, micro_batch_size=BATCH,
                           forward_only=False)
            scheduler.step(1)
            norm = clip_by_global_norm(params, 1.0, pgs.tp, pgs.mp)
            optimizer.step()
            losses.append(float(out[0]["loss"]))
            if dist.get_rank() == 0 and (step % 5 == 0 or step == args.steps - 1):
                print(f"step {step + 1:>3}  loss {losses[-1]:.4f}  grad norm {norm:.3f}  "
                      f"lr {optimizer.param_groups[0]['lr']:.2e}", flush=True)
        if args.save is not None:
            save_and_reload(model, args, pgs)
        return losses
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


METADATA = {"non_homogeneous_layers": True}  # per-layer keys: every layer has its own ranks


def save_and_reload(model: Any, args: argparse.Namespace, pgs: Any) -> None:
    """Megatron's dist checkpoint of the trained model, loaded under the other factored layout."""
    from megatron.core import dist_checkpointing

    if dist.get_rank() == 0:
        args.save.mkdir(parents=True)  # Megatron writes into an existing, empty folder
    dist.barrier()
    dist_checkpointing.save({"model": model.sharded_state_dict(metadata=METADATA)}, str(args.save))
    other = build_model(args.tp, "naive" if args.layout == "deinfer" else "deinfer", pgs, args.seed + 1)
    loaded = dist_checkpointing.load({"model": other.sharded_state_dict(metadata=METADATA)}, str(args.save))
    other.load_state_dict(loaded["model"], strict=True)
    ids = toy_batch(10_000, model.vocab_size)["input_ids"]
    positions = torch.arange(SEQ).expand(BATCH, -1)
    with torch.inference_mode():
        want = model.eval()(ids, positions, None, runtime_gather_output=True)
        got = other.eval()(ids, positions, None, runtime_gather_output=True)
    if dist.get_rank() == 0:
        layout = "naive" if args.layout == "deinfer" else "deinfer"
        print(f"saved a dist checkpoint to {args.save}")
        print(f"reloaded under {layout}: max |logit difference| {(got - want).abs().max().item():.3g}")


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (= ranks started)")
    parser.add_argument("--layout", default="deinfer", choices=("deinfer", "naive", "dense"))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write {'losses': [...]} here (rank 0)")
    parser.add_argument("--save", type=Path, help="save a Megatron dist checkpoint here (must not exist)")
    args = parser.parse_args(argv)
    if args.steps < 4:
        parser.error("--steps must be at least 4 (3 warm-up steps, then the cosine)")
    if args.save is not None and args.save.exists():
        parser.error(f"--save {args.save} exists; choose a new folder (nothing is overwritten)")
    if args.save is not None and args.layout == "dense":
        parser.error("--save compares the reload under the other factored layout; train with deinfer or naive")
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron(\.|$)")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"megatron\.core\.dist_checkpointing")
    losses = train(args)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps")
        if args.json:  # written whole or not at all
            tmp = args.json.with_name(args.json.name + ".tmp")
            tmp.write_text(json.dumps({"losses": losses}))
            tmp.replace(args.json)
    return losses


if __name__ == "__main__":
    main()

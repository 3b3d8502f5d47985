"""One model step of continuous batching, run identically on every rank.

Rank 0's scheduler describes a step as a ``StepPlan`` — which sequences decode one token, which
one prefills a chunk of its prompt, which start (with their sampling parameters) and which are
released — and sends it to every rank (``exchange_plan``). Each rank then runs the same
forwards over its TP shard / PP stage (``StepRunner.run``): the decode rows as one batch of
single tokens, each row at its own position in its own KV slot, and the prefill chunk as a batch
of one. The last stage samples each row with that sequence's own generator (seeded when the
sequence started, so every rank draws alike) and the tokens are broadcast to all stages.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field

import torch

from deinfer_megatron.generation.sampling import SamplingParams, sample
from deinfer_megatron.layers.attention import FactoredSelfAttention
from deinfer_megatron.layers.slot_cache import SlotContext
from deinfer_megatron.models.build import Stage
from deinfer_megatron.models.pipeline import broadcast_from_last_stage, stage_forward
from deinfer_megatron.parallel import comm


@dataclass(frozen=True)
class DecodeRow:
    """Sequence ``seq`` feeds ``token`` at ``position`` of its ``slot``."""

    seq: int
    slot: int
    position: int
    token: int


@dataclass(frozen=True)
class PrefillChunk:
    """Sequence ``seq`` feeds prompt ``tokens`` from ``start`` in its ``slot``; ``last``: the
    chunk ends the prompt, so its logits give the first generated token."""

    seq: int
    slot: int
    start: int
    tokens: tuple[int, ...]
    last: bool


@dataclass
class StepPlan:
    """What every rank does next. An empty plan is a heartbeat (the ranks wait in the
    broadcast, which has a timeout); ``stop`` ends the loop on every rank."""

    decode: list[DecodeRow] = field(default_factory=list)
    prefill: PrefillChunk | None = None
    start: dict[int, SamplingParams] = field(default_factory=dict)  # sequences starting now
    release: list[int] = field(default_factory=list)  # sequences whose generators go
    stop: bool = False

    @property
    def sampled(self) -> list[int]:
        """The sequences this step draws a token for, in the order ``run`` returns them."""
        rows = [r.seq for r in self.decode]
        if self.prefill is not None and self.prefill.last:
            rows.append(self.prefill.seq)
        return rows


def exchange_plan(plan: StepPlan | None, device: torch.device) -> StepPlan:
    """Rank 0's plan on every rank (rank 0 passes it, the others None). Pickle is used between
    the job's own ranks only, which trust each other as they trust the weights they share."""
    payload = pickle.dumps(plan) if plan is not None else None
    return pickle.loads(comm.broadcast_bytes(payload, 0, device))


def require_slot_attention(stage: Stage) -> None:
    """Continuous batching needs the project's decomposed attention in every layer: Megatron's
    own attention keeps one position for the whole batch."""
    decoder = getattr(stage.model, "decoder", None)
    layers = getattr(decoder, "layers", [])
    dense = [i + stage.layer_offset for i, layer in enumerate(layers)
             if not isinstance(layer.self_attention, FactoredSelfAttention)]
    if dense:
        raise ValueError(
            f"serve needs every attention block decomposed (per-request positions); layers {dense} "
            "keep Megatron's dense attention — serve a decomposed folder in the deinfer or naive layout"
        )


class StepRunner:
    """Runs ``StepPlan``s on this rank's stage over a ``SlotContext``."""

    def __init__(self, stage: Stage, context: SlotContext) -> None:
        require_slot_attention(stage)
        self.stage = stage
        self.context = context
        self.params: dict[int, SamplingParams] = {}
        self.generators: dict[int, torch.Generator] = {}

    def _forward(self, slots: list[int], starts: list[int], tokens: torch.Tensor) -> torch.Tensor | None:
        device = self.stage.device
        self.context.begin_step(slots, starts, tokens.shape[1], device)
        positions = torch.tensor(starts, dtype=torch.long).unsqueeze(1) + torch.arange(tokens.shape[1])
        logits = stage_forward(self.stage, tokens, positions, inference_context=self.context)
        return None if logits is None else logits[:, -1]

    def _sample(self, seqs: list[int], logits: torch.Tensor) -> torch.Tensor:
        """Each row with its own parameters and generator; greedy rows in one argmax."""
        chosen = logits.argmax(dim=-1)
        for i, s in enumerate(seqs):
            if not self.params[s].greedy:
                chosen[i] = sample(logits[i : i + 1], self.params[s], self.generators[s])[0]
        return chosen

    def run(self, plan: StepPlan) -> list[int]:
        """The tokens drawn for ``plan.sampled``, on every rank."""
        for seq in plan.release:
            self.params.pop(seq, None)
            self.generators.pop(seq, None)
        for seq, params in plan.start.items():
            self.params[seq] = params
            self.generators[seq] = torch.Generator(device=self.stage.device).manual_seed(params.seed)
        chosen: list[torch.Tensor] = []
        if plan.decode:
            tokens = torch.tensor([[r.token] for r in plan.decode], dtype=torch.long)
            logits = self._forward([r.slot for r in plan.decode], [r.position for r in plan.decode], tokens)
            if logits is not None:
                chosen.append(self._sample([r.seq for r in plan.decode], logits))
        chunk = plan.prefill
        if chunk is not None:
            logits = self._forward([chunk.slot], [chunk.start], torch.tensor([chunk.tokens], dtype=torch.long))
            if logits is not None and chunk.last:
                chosen.append(self._sample([chunk.seq], logits))
        count = len(plan.sampled)
        if count == 0:
            return []
        mine = torch.cat(chosen).to(self.stage.device) if chosen else None
        like = torch.zeros(count, dtype=torch.long, device=self.stage.device)
        return broadcast_from_last_stage(self.stage, mine, like).tolist()

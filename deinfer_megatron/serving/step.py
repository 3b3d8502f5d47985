"""One model step of continuous batching, run identically on every rank.

Rank 0's scheduler describes a step as a ``StepPlan`` — its rows (each a sequence's tokens
from a start position, with the sequence's block table, and whether its last token samples),
which sequences start (with their sampling parameters) and which are released — and sends it to
every rank (``exchange_plan``). Each rank then runs the whole step as one forward over its TP
shard / PP stage (``StepRunner.run``): the rows' tokens packed into one row of the model, each
token at its own position in its own sequence's blocks (``layers.paged_cache``), so the
decoding sequences and the prompt chunks of arriving ones read the weights once. The last stage
samples each sampling row with that sequence's own generator (seeded when the sequence started,
so every rank draws alike) and the tokens are broadcast to all stages.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field

import torch

from deinfer_megatron.generation.sampling import SamplingParams, sample
from deinfer_megatron.layers.attention import FactoredSelfAttention
from deinfer_megatron.layers.dense import PagedSelfAttention
from deinfer_megatron.layers.paged_cache import PagedContext, PagedRow
from deinfer_megatron.models.build import Stage
from deinfer_megatron.models.pipeline import broadcast_from_last_stage, stage_forward
from deinfer_megatron.parallel import comm


@dataclass(frozen=True)
class Row:
    """Sequence ``seq`` feeds ``tokens`` from position ``start``, in the blocks ``table``;
    ``sample``: its last token's logits give the sequence's next token (a decode step, or the
    chunk that ends its prompt); ``prompt``: the tokens are the prompt's (a prefill chunk, which
    may be a single token when the prefix cache held the rest)."""

    seq: int
    start: int
    tokens: tuple[int, ...]
    table: tuple[int, ...]
    sample: bool
    prompt: bool = False


@dataclass
class StepPlan:
    """What every rank does next. An empty plan is a heartbeat (the ranks wait in the
    broadcast, which has a timeout); ``stop`` ends the loop on every rank."""

    rows: list[Row] = field(default_factory=list)
    start: dict[int, SamplingParams] = field(default_factory=dict)  # sequences starting now
    release: list[int] = field(default_factory=list)  # sequences whose generators go
    stop: bool = False

    @property
    def sampled(self) -> list[int]:
        """The sequences this step draws a token for, in the order ``run`` returns them."""
        return [r.seq for r in self.rows if r.sample]

    @property
    def decoded(self) -> int:
        """Rows that decode: one generated token each."""
        return sum(1 for r in self.rows if not r.prompt)

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens fed in this step, over all prefill chunks."""
        return sum(len(r.tokens) for r in self.rows if r.prompt)


def exchange_plan(plan: StepPlan | None, device: torch.device) -> StepPlan:
    """Rank 0's plan on every rank (rank 0 passes it, the others None). Pickle is used between
    the job's own ranks only, which trust each other as they trust the weights they share."""
    payload = pickle.dumps(plan) if plan is not None else None
    return pickle.loads(comm.broadcast_bytes(payload, 0, device))


def require_paged_attention(stage: Stage) -> None:
    """Continuous batching needs attention that keeps each token's own sequence, position and KV
    block: the project's decomposed attention and ``PagedSelfAttention`` (a block kept dense) do;
    Megatron's plain ``SelfAttention`` keeps one position for the whole batch."""
    decoder = getattr(stage.model, "decoder", None)
    layers = getattr(decoder, "layers", [])
    other = [i + stage.layer_offset for i, layer in enumerate(layers)
             if not isinstance(layer.self_attention, (FactoredSelfAttention, PagedSelfAttention))]
    if other:
        raise ValueError(
            f"serve needs attention blocks that run a paged KV pool; layers {other} hold "
            f"{type(layers[other[0] - stage.layer_offset].self_attention).__name__} — build the model with "
            "specs.builder.decomposed_block_spec"
        )


class StepRunner:
    """Runs ``StepPlan``s on this rank's stage over a ``PagedContext``."""

    def __init__(self, stage: Stage, context: PagedContext) -> None:
        require_paged_attention(stage)
        self.stage = stage
        self.context = context
        self.params: dict[int, SamplingParams] = {}
        self.generators: dict[int, torch.Generator] = {}

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
        if not plan.rows:
            return []
        device = self.stage.device
        self.context.begin_step([PagedRow(r.start, len(r.tokens), r.table, r.sample) for r in plan.rows], device)
        tokens = torch.tensor([t for r in plan.rows for t in r.tokens], dtype=torch.long).unsqueeze(0)
        positions = self.context.positions.t()  # [1, T]
        logits = stage_forward(self.stage, tokens, positions, inference_context=self.context)
        seqs = plan.sampled
        if not seqs:
            return []
        mine = None if logits is None else self._sample(seqs, logits[0])
        like = torch.zeros(len(seqs), dtype=torch.long, device=device)
        return broadcast_from_last_stage(self.stage, mine, like).tolist()

"""Calibration data and layer-by-layer activation statistics on a Hugging Face model.

The model is run one decoder layer at a time over stored hidden states, so that a layer's
statistics can come from the *already decomposed* layers before it (sequential calibration)
at the cost of one pass per layer, not one whole-model pass per layer. Statistics are
accumulated while the data streams through (Gram matrix ``XᵀX`` and mean ``|x|`` per linear
input), so memory is bounded by one ``in × in`` matrix per captured linear plus the hidden
states of the calibration tokens.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch
from torch import nn

from deinfer_megatron.arch.family import family_for_model_type
from deinfer_megatron.checkpoints.hf_names import FINAL_NORM, POSITION_EMBEDDINGS, WORD_EMBEDDINGS, hf_global_name
from deinfer_megatron.decompose.sampling import sample_rows
from deinfer_megatron.files.text import read_text


class StopForward(Exception):
    """Raised by a capture hook once the last needed input is seen: the rest of the layer
    would be computed for nothing."""


class InputStats:
    """Running ``XᵀX`` and ``Σ|x|`` of one linear layer's input — and, given the dense model's
    inputs at the same tokens (``reference``: one tensor per batch, in the order the batches
    come), the cross term ``X_dᵀX`` the parameter update fits against (decompose/update.py).

    Each batch's product is computed in float32 (the GEMM dominates calibration time) and
    accumulated in float64, so rounding does not grow with the number of batches."""

    def __init__(self, features: int, reference: Sequence[torch.Tensor] | None = None) -> None:
        self.gram = torch.zeros(features, features, dtype=torch.float64)
        self.abs_sum = torch.zeros(features, dtype=torch.float64)
        self.rows = 0
        self.reference = reference
        self.cross = None if reference is None else torch.zeros(features, features, dtype=torch.float64)
        self._batches = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        self.gram += (x.T @ x).double()
        self.abs_sum += x.abs().sum(0, dtype=torch.float64)
        self.rows += x.shape[0]
        if self.reference is not None and self.cross is not None:
            dense = self.reference[self._batches].reshape(-1, x.shape[-1]).float()
            assert dense.shape == x.shape, "the dense and the decomposed stream hold the same tokens"
            self.cross += (dense.T @ x).double()
        self._batches += 1

    @property
    def abs_mean(self) -> torch.Tensor:
        return self.abs_sum / max(self.rows, 1)


# ------------------------------------------------------------------------------ data sources

# Sampling temperature of the model's own calibration and healing text (--calib-temperature).
# The default, pure sampling, gives the decomposition the diversity held-out text needs: SmolLM2
# at ratio 0.8 (fisher) calibrated on conversations sampled at 0.7 measured 5.58x dense on the
# held-out novel against 2.78x at 1.0 (docs/DECOMPOSITION.md). But at 1.0 a 135M chat model
# writes incoherent user turns ("The golden-antenna 66 is just 100 years away from limo…"), and
# a model calibrated and healed on them answered chat prompts wrongly; the demo, a chat demo,
# samples at 0.7 (cli/demo_cmd.DEMO_TEMPERATURE) — though whether its healed 0.8 model names
# "Paris" hung on a few points of probability until its heal matched each block first
# (docs/HEALING.md measures the margin).
SELF_TEMPERATURE = 1.0

# How the model answers its own questions (--calib-answers): at the sampling temperature, or
# greedily — what the model says when it is served with greedy decoding, which is what a heal
# aimed at the served answers trains towards (the demo heals on greedy answers: docs/HEALING.md).
ANSWERS = ("sampled", "greedy")


def check_temperature(temperature: float | None, calib_self: int | None) -> None:
    """``--calib-temperature`` only means something for the model's own text, and must be > 0."""
    if temperature is None:
        return
    if not calib_self:
        raise ValueError("--calib-temperature sets how the model samples its own --calib-self text; "
                         "pass --calib-self N or drop --calib-temperature")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"--calib-temperature must be a positive number, got {temperature}")


def check_answers(answers: str, calib_self: int | None) -> None:
    """``--calib-answers`` is ``sampled`` or ``greedy``, and ``greedy`` needs ``--calib-self``."""
    if answers not in ANSWERS:
        raise ValueError(f"unknown --calib-answers {answers!r}; choose one of {', '.join(ANSWERS)}")
    if answers != "sampled" and not calib_self:
        raise ValueError("--calib-answers sets how the model answers its own --calib-self conversations; "
                         "pass --calib-self N or drop --calib-answers")


def answer_temperature(answers: str) -> float | None:
    """The answers' own sampling temperature for :func:`self_conversations`: 0 (greedy) or None
    (the questions' temperature)."""
    return 0.0 if answers == "greedy" else None


def text_windows(tokenizer: Any, paths: str | Path | Sequence[str | Path], *, seq_len: int,
                 max_tokens: int) -> torch.Tensor:
    """Non-overlapping ``[n, seq_len]`` token windows from one or more text files (at most
    ``max_tokens`` in all).

    Several files share the windows equally (the first ones take the remainder), each giving
    its own first windows in the order named: a calibration then spans the kinds of text the
    model will see — a novel and technical prose, say — instead of the first file filling it."""
    files = [Path(paths)] if isinstance(paths, (str, Path)) else [Path(p) for p in paths]
    total = max_tokens // seq_len
    check_text_budget(len(files), seq_len=seq_len, max_tokens=max_tokens)
    rows = []
    for i, path in enumerate(files):
        share = total // len(files) + (i < total % len(files))
        # Reading a bounded prefix keeps tokenisation cheap on large files.
        text = read_text(path, "calibration text", max_chars=share * seq_len * 12)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        n = min(len(ids) // seq_len, share)
        if n == 0:
            raise ValueError(
                f"calibration text {path} has {len(ids)} tokens, fewer than one window of {seq_len}; "
                "give a longer file or a smaller --calib-seq-len"
            )
        rows.append(torch.tensor(ids[: n * seq_len]).view(n, seq_len))
    return torch.cat(rows)


def check_text_budget(files: int, *, seq_len: int, max_tokens: int) -> None:
    """Every calibration file needs at least one window of the budget."""
    if max_tokens // seq_len < files:
        raise ValueError(f"--calib-tokens {max_tokens} makes {max_tokens // seq_len} windows of {seq_len} for "
                         f"{files} --calib-text files; give at least {files * seq_len} tokens or fewer files")


def self_samples(model: nn.Module, bos_id: int, *, n: int, seq_len: int, seed: int = 0,
                 temperature: float = SELF_TEMPERATURE) -> torch.Tensor:
    """``n`` sequences the model samples itself from its BOS token (at ``temperature``, no
    top-k/p): calibration data without any external text.

    Sampling does not stop at the end-of-sequence token: the model goes on as it would after
    it (for a chat model, the next turn), so the data keeps the model's own format — special
    tokens included — rather than prose with end-of-sequence suppressed."""
    rows = sample_rows(model, [[bos_id]] * n, max_new_tokens=seq_len - 1, temperature=temperature, eos_id=None,
                       generator=torch.Generator().manual_seed(seed))
    return torch.tensor([[bos_id] + row for row in rows])


def self_dialogues(model: nn.Module, tokenizer: Any, *, n: int, seq_len: int, seed: int = 0,
                   temperature: float = SELF_TEMPERATURE, answers: str = "sampled") -> torch.Tensor:
    """``[n, seq_len]`` windows of conversations a chat model writes itself
    (:func:`self_conversations`, concatenated and cut into windows; ``answers`` one of
    :data:`ANSWERS`). No external data."""
    texts = self_conversations(model, tokenizer, tokens=n * seq_len, rows=n, seq_len=seq_len, seed=seed,
                               temperature=temperature, answer_temperature=answer_temperature(answers))
    stream = [t for text in texts for t in tokenizer(text, add_special_tokens=False)["input_ids"]]
    return torch.tensor(stream[: n * seq_len]).view(n, seq_len)


def self_conversations(model: nn.Module, tokenizer: Any, *, tokens: int, rows: int, seq_len: int, seed: int = 0,
                       temperature: float = SELF_TEMPERATURE, answer_temperature: float | None = None) -> list[str]:
    """Conversations a chat model writes itself, rendered in its chat template (each closed by
    its end-of-sequence token and a newline), until they hold at least ``tokens`` tokens.

    Text sampled from BOS alone never shows a chat model its own turn structure, and a model
    compressed on such data loses the ability to answer in its template. So the model first
    writes user messages (sampled after the template's opening of a user turn), then answers
    them (both turns sampled at ``temperature``, no top-k/p, at most ``seq_len`` tokens an
    answer; ``answer_temperature``, when given, is the answers' own — 0 answers greedily, what
    greedy decoding of the questions gives). The first round writes ``rows`` conversations at
    once; when they fall short, the next rounds write only as many as the shortfall needs at the
    length seen so far (a fifth more, so a third round is rare) rather than another ``rows``.
    """
    marker = "\x00"
    opening = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    opening = tokenizer(opening[: opening.index(marker)], add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    generator = torch.Generator().manual_seed(seed)
    texts: list[str] = []
    have, first = 0, rows
    while have < tokens:
        asked = sample_rows(model, [opening] * rows, max_new_tokens=48, temperature=temperature, eos_id=eos,
                            generator=generator)
        users = [tokenizer.decode(r, skip_special_tokens=True).strip() for r in asked]
        chats = [tokenizer.apply_chat_template([{"role": "user", "content": u}], tokenize=False,
                                               add_generation_prompt=True) for u in users]
        prompts = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in chats]
        answers = sample_rows(model, prompts, max_new_tokens=seq_len, eos_id=eos,
                              temperature=temperature if answer_temperature is None else answer_temperature,
                              generator=generator)
        for chat, answer in zip(chats, answers):
            texts.append(chat + tokenizer.decode(answer, skip_special_tokens=True) + (tokenizer.eos_token or "") + "\n")
            have += len(tokenizer(texts[-1], add_special_tokens=False)["input_ids"])
        rows = min(first, max(1, math.ceil(1.2 * (tokens - have) * len(texts) / have)))
    return texts


# ---------------------------------------------------------------------------- layer runner


class LayerRunner:
    """Runs the decoder layers of a Hugging Face ``*ForCausalLM`` one at a time; its family's
    record (from ``model_type``) and the name table say where the embeddings, positions, layers
    and final norm are."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.family = family_for_model_type(model.config.model_type)
        self.core = model.get_submodule(self.family.decoder_prefix)
        self.layers: Sequence[nn.Module] = self.core.layers
        self.embed_tokens = model.get_submodule(_module(hf_global_name(self.family, WORD_EMBEDDINGS)))
        self.norm = model.get_submodule(_module(hf_global_name(self.family, FINAL_NORM)))
        positions = hf_global_name(self.family, POSITION_EMBEDDINGS)
        self.positions = None if positions is None else model.get_parameter(positions)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(ids)
        if self.positions is not None:  # learned positions, after the family's offset rows
            hidden = hidden + self.positions[torch.arange(ids.shape[1]) + self.family.position_offset]
        return hidden

    def _kwargs(self, hidden: torch.Tensor) -> dict[str, Any]:
        if not self.family.rotary:
            return {}
        pos = torch.arange(hidden.shape[1]).unsqueeze(0)
        return {"position_ids": pos, "position_embeddings": self.core.rotary_emb(hidden, pos)}

    def run_layer(self, index: int, hidden: torch.Tensor) -> torch.Tensor:
        """Layer ``index`` on ``[b, s, h]`` (causal; no mask needed without padding)."""
        out = self.layers[index](hidden, attention_mask=None, **self._kwargs(hidden))
        return out[0] if isinstance(out, tuple) else out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.norm(hidden))


def _module(hf_name: str | None) -> str:
    assert hf_name is not None, "the name table lacks a global tensor every family has"
    return hf_name.rpartition(".")[0]


@contextmanager
def capture(
    linears: dict[str, nn.Linear], stop_after: str | None = None,
    references: Mapping[str, Sequence[torch.Tensor]] | None = None,
) -> Iterator[dict[str, InputStats]]:
    """Accumulate the inputs of ``linears`` while the block runs (and their cross terms with
    ``references``, the dense model's inputs per batch); raise ``StopForward`` after
    ``stop_after``'s input is recorded (callers catch it)."""
    references = references or {}
    stats = {name: InputStats(lin.in_features, references.get(name)) for name, lin in linears.items()}
    handles = []
    for name, lin in linears.items():
        def hook(_mod: nn.Module, args: tuple, name: str = name) -> None:
            stats[name].add(args[0].detach())
            if name == stop_after:
                raise StopForward

        handles.append(lin.register_forward_pre_hook(hook))
    try:
        yield stats
    finally:
        for h in handles:
            h.remove()


def collect(
    runner: LayerRunner,
    index: int,
    hidden: Sequence[torch.Tensor],
    linears: dict[str, nn.Linear],
    stop_after: str | None = None,
    references: Mapping[str, Sequence[torch.Tensor]] | None = None,
) -> dict[str, InputStats]:
    """Run layer ``index`` over every stored batch and return the input statistics."""
    with capture(linears, stop_after, references) as stats, torch.no_grad():
        for h in hidden:
            try:
                runner.run_layer(index, h)
            except StopForward:
                pass
    return stats


def record_inputs(
    runner: LayerRunner, index: int, hidden: Sequence[torch.Tensor], linears: dict[str, nn.Linear]
) -> tuple[dict[str, list[torch.Tensor]], list[torch.Tensor]]:
    """Run layer ``index`` over every stored batch, keeping the inputs of ``linears`` as they
    are (one tensor per batch) and the layer's outputs: the dense model's side of the update's
    cross terms, and its next layer's input."""
    kept: dict[str, list[torch.Tensor]] = {name: [] for name in linears}
    handles = []
    for name, lin in linears.items():
        def hook(_mod: nn.Module, args: tuple, name: str = name) -> None:
            kept[name].append(args[0].detach().float().clone())

        handles.append(lin.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            outputs = [runner.run_layer(index, h) for h in hidden]
    finally:
        for h in handles:
            h.remove()
    return kept, outputs

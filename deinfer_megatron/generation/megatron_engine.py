"""Generation driven by Megatron-Core's ``TextGenerationController`` (its static-batch path).

The controller drives the project's model as is: decomposed attention keeps its cache (full or
latent, with value absorption) in the controller's static inference context, which here is a
``GenerationContext``. The controller is subclassed only to report tokens as they are generated,
to stop on the project's stop condition (Megatron's static path stops on one EOD id only), and
to leave text to the job (below).

Megatron-Core 0.16.1, and what it offers for each thing the project needs:

- ``StaticInferenceEngine.run_engine`` is a scheduler loop around
  ``controller.generate_all_output_tokens_static_batch`` that draws a tqdm bar on every rank,
  unconditionally (no argument turns it off). Every request fits one batch here (one slot per
  prompt), so the engine's loop would make exactly one call of that public controller method:
  it is called directly, and nothing of Megatron's is patched.
- The sampling seed: the controller seeds its own generator, ``sampling_rng`` (the one every
  draw uses), from ``model_config.inference_sampling_seed`` when it is constructed. That
  generator is re-seeded with the request's seed, so the model's shared ``TransformerConfig``
  is never written.
- Prompts go in as ``InferenceRequest.prompt_tokens``. The static path then detokenizes every
  request on every rank; the project decodes once, on the reporting rank, with the model's own
  tokenizer and the ``--stop`` strings applied (``job.py``), so the controller is given a
  tokenizer that knows only the ids it needs (``TokenIds``) and returns no text.

What Megatron's controller cannot carry falls back to the project's loop (``loop.py``): top-k
and top-p together (Megatron asserts), and more than one end-of-sequence id.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import torch
from megatron.core.inference.inference_request import InferenceRequest
from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import InferenceWrapperConfig
from megatron.core.inference.sampling_params import SamplingParams as MegatronSampling
from megatron.core.inference.text_generation_controllers.text_generation_controller import (
    TextGenerationController,
)

from deinfer_megatron.generation.context import GenerationContext
from deinfer_megatron.generation.loop import Generated, OnToken, StopCheck, Timing
from deinfer_megatron.generation.prefill import DEFAULT_MAX_PREFILL_TOKENS, ChunkedPrefillWrapper
from deinfer_megatron.generation.sampling import SamplingParams
from deinfer_megatron.models.build import Stage


def engine_supports(params: SamplingParams, eos_ids: frozenset[int]) -> str | None:
    """None when Megatron's engine can run the request, else why not."""
    if not params.greedy and params.top_k and params.top_p < 1.0:
        return "Megatron's engine does not combine top-k with top-p"
    if len(eos_ids) > 1:
        return "Megatron's engine stops on a single end-of-sequence id"
    return None


@dataclass(frozen=True)
class TokenIds:
    """What the static controller reads of a tokenizer when prompts arrive as token ids: the
    end-of-document id (it pads with it, and stops on it) and that no BOS is to be added. It
    has no ``tokenize``/``detokenize``: text never passes through the controller here."""

    eod: int
    vocab_size: int
    bos: int | None = None


class ReportingController(TextGenerationController):
    """Megatron's controller, reporting each new token and applying the project's stop condition
    every step.

    Args:
        wrapper: the model inside Megatron's ``GPTInferenceWrapper`` (chunking its prefill).
        tokenizer: the ids the controller needs (``TokenIds``).
        prompt_lengths: tokens of each prompt, by row.
        stop: ``(row, generated ids) → stop now?``, checked after every token.
        on_token: ``(row, token id)`` for each generated token, as it is generated.
        seed: the sampling generator's seed.
    """

    def __init__(self, wrapper: ChunkedPrefillWrapper, tokenizer: TokenIds, *, prompt_lengths: Sequence[int],
                 stop: StopCheck | None = None, on_token: OnToken | None = None, seed: int = 0) -> None:
        super().__init__(wrapper, tokenizer)
        self.sampling_rng.manual_seed(seed)  # instead of writing the shared model config's seed
        self.prompt_lengths = list(prompt_lengths)
        self.stop = stop
        self.on_token = on_token
        self.first_step_at: float | None = None  # when the prefill's logits were turned into tokens

    def update_generation_status(
        self,
        updated_prompts_tokens: torch.Tensor,
        generation_started: torch.Tensor,
        current_context_end_position: int,
        is_generation_done_tensor: torch.Tensor,
        generated_sequence_lengths: torch.Tensor,
        termination_id: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.first_step_at is None:  # the prefill has just produced logits
            self.first_step_at = time.perf_counter()
        tokens, position = updated_prompts_tokens, current_context_end_position
        was_done = is_generation_done_tensor.clone()
        done, lengths = super().update_generation_status(
            tokens, generation_started, position, is_generation_done_tensor,
            generated_sequence_lengths, termination_id)
        for row, prompt_length in enumerate(self.prompt_lengths):
            if bool(was_done[row]) or position < prompt_length:
                continue
            generated = tokens[row, prompt_length : position + 1].tolist()
            if self.on_token is not None:
                self.on_token(row, generated[-1])
            if self.stop is not None and self.stop(row, generated):
                done[row] = True
        return done, lengths

    def detokenize_generations(self, tokens_gpu_tensor: torch.Tensor, lengths_gpu_tensor: torch.Tensor,
                               detokenize_segments: bool, skip_special_tokens: bool = True
                               ) -> tuple[str, list[list[str]] | None]:
        """No text: the job decodes the generated ids itself, once, on the reporting rank."""
        return "", None


def _megatron_sampling(params: SamplingParams, max_new_tokens: int, stops_on_eod: bool) -> MegatronSampling:
    """The project's sampling parameters in Megatron's terms (greedy is top-k 1)."""
    sampling = MegatronSampling(
        temperature=1.0 if params.greedy else params.temperature,
        top_k=1 if params.greedy else params.top_k,
        top_p=0.0 if params.greedy or params.top_p >= 1.0 else params.top_p,
        num_tokens_to_generate=max_new_tokens,
    )
    if not stops_on_eod:
        sampling.add_attributes({"no_early_termination": True})
    return sampling


def _wrapper_config(stage: Stage, context: GenerationContext) -> InferenceWrapperConfig:
    """What Megatron's inference wrapper reads of the model and of the context's sizes."""
    return InferenceWrapperConfig(
        hidden_size=stage.arch.hidden_size,
        params_dtype=stage.model.config.params_dtype,
        inference_batch_times_seqlen_threshold=-1,
        padded_vocab_size=stage.padded_vocab,
        inference_max_requests=context.max_batch_size,
        inference_max_seq_length=context.max_sequence_length,
    )


def generate_with_engine(
    stage: Stage,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    params: SamplingParams,
    context: GenerationContext,
    eos_ids: frozenset[int] = frozenset(),
    stop: StopCheck | None = None,
    on_token: OnToken | None = None,
    max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS,
) -> tuple[list[Generated], Timing]:
    """Generate with Megatron's controller driving ``stage.driver`` (the model, or the engine
    wrapping it: ``runtime.engines``). The prefill forwards at most ``max_prefill_tokens`` rows
    at a time (``prefill.py``)."""
    reason = engine_supports(params, eos_ids)
    if reason is not None:
        raise ValueError(reason)
    assert len(prompts) <= context.max_batch_size, "the context needs one slot per prompt"
    module = stage.driver
    eod = next(iter(eos_ids)) if eos_ids else stage.padded_vocab - 1
    wrapper = ChunkedPrefillWrapper(module, _wrapper_config(stage, context), context, max_tokens=max_prefill_tokens)
    controller = ReportingController(wrapper, TokenIds(eod, stage.arch.vocab_size),
                                     prompt_lengths=[len(p) for p in prompts], stop=stop,
                                     on_token=on_token, seed=params.seed)
    sampling = _megatron_sampling(params, max_new_tokens, stops_on_eod=bool(eos_ids))
    requests = OrderedDict(
        (str(i), InferenceRequest(request_id=str(i), prompt="", prompt_tokens=list(p), sampling_params=sampling))
        for i, p in enumerate(prompts))
    start = time.perf_counter()
    with torch.inference_mode():
        results = controller.generate_all_output_tokens_static_batch(requests)
    end = time.perf_counter()
    first = controller.first_step_at or end
    outputs = [_generated(list(p), results[str(i)], i, max_new_tokens, eod, eos_ids, stop)
               for i, p in enumerate(prompts)]
    # the first token of each row comes out of the prefill; the rest are decode steps
    decoded = sum(max(0, len(o.token_ids) - 1) for o in outputs)
    return outputs, Timing(prefill_s=first - start, decode_s=end - first, decode_tokens=decoded)


def _generated(prompt: list[int], result: InferenceRequest, row: int, max_new_tokens: int, eod: int,
               eos_ids: frozenset[int], stop: StopCheck | None) -> Generated:
    """One request's result as the project reports it (the EOD it stopped on included, as HF)."""
    ids = [int(t) for t in result.generated_tokens.tolist()][: int(result.generated_length)]
    out = Generated(prompt, ids)
    if len(ids) < max_new_tokens and eos_ids and not (stop is not None and stop(row, ids)):
        out.token_ids.append(eod)  # Megatron drops the EOD it stopped on; report it like HF
        out.finish_reason = "eos"
    elif stop is not None and ids and stop(row, ids):
        out.finish_reason = "stop"
    else:
        out.finish_reason = "length"
    return out

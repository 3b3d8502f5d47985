"""Generation driven by Megatron-Core's ``StaticInferenceEngine`` / ``TextGenerationController``.

The engine drives the project's model as is: decomposed attention keeps its cache (full or
latent, with value absorption) in the engine's static inference context, which here is a
``GenerationContext``. The controller is subclassed only to report tokens as they are generated
and to stop on the project's stop condition (Megatron's static path stops on one EOD id only).

What Megatron's engine cannot carry falls back to the project's loop (``loop.py``): top-k and
top-p together (Megatron asserts), and more than one end-of-sequence id.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any, Iterator, Sequence

import torch

from deinfer_megatron.generation.context import GenerationContext
from deinfer_megatron.generation.loop import Generated, OnToken, StopCheck, Timing
from deinfer_megatron.generation.sampling import SamplingParams
from deinfer_megatron.models.build import Stage


@contextlib.contextmanager
def _quiet_progress_bar() -> Iterator[None]:
    """``StaticInferenceEngine.run_engine`` draws a tqdm bar on every rank, unconditionally;
    the project streams tokens instead, so the bar is disabled while the engine runs."""
    from megatron.core.inference.engines import static_engine

    bar = static_engine.tqdm
    static_engine.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        static_engine.tqdm = bar


def engine_supports(params: SamplingParams, eos_ids: frozenset[int]) -> str | None:
    """None when Megatron's engine can run the request, else why not."""
    if not params.greedy and params.top_k and params.top_p < 1.0:
        return "Megatron's engine does not combine top-k with top-p"
    if len(eos_ids) > 1:
        return "Megatron's engine stops on a single end-of-sequence id"
    return None


class _IdTokenizer:
    """What the static controller needs of a tokenizer, when prompts are already token ids."""

    def __init__(self, eod: int, vocab_size: int) -> None:
        self.eod, self.bos, self.vocab_size = eod, None, vocab_size

    def tokenize(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def detokenize(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return " ".join(str(int(t)) for t in ids)

    def offsets(self, ids: Sequence[int], text: str) -> list[int]:
        out, pos = [], 0
        for t in ids:
            out.append(pos)
            pos += len(str(int(t))) + 1
        return out


def _controller_class(stop: StopCheck | None, on_token: OnToken | None, prompt_lengths: list[int]) -> type:
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    class ReportingController(TextGenerationController):
        """Reports each new token and applies the project's stop condition every step."""

        first_step_at: float | None = None

        def update_generation_status(
            self,
            updated_prompts_tokens: torch.Tensor,
            generation_started: torch.Tensor,
            current_context_end_position: int,
            is_generation_done_tensor: torch.Tensor,
            generated_sequence_lengths: torch.Tensor,
            termination_id: int | None = None,
        ) -> tuple[torch.Tensor, torch.Tensor]:
            if ReportingController.first_step_at is None:  # the prefill has just produced logits
                ReportingController.first_step_at = time.perf_counter()
            tokens, position = updated_prompts_tokens, current_context_end_position
            was_done = is_generation_done_tensor.clone()
            done, lengths = super().update_generation_status(
                tokens, generation_started, position, is_generation_done_tensor,
                generated_sequence_lengths, termination_id)
            for row in range(tokens.shape[0]):
                if bool(was_done[row]) or position < prompt_lengths[row]:
                    continue
                generated = tokens[row, prompt_lengths[row] : position + 1].tolist()
                if on_token is not None:
                    on_token(row, generated[-1])
                if stop is not None and stop(row, generated):
                    done[row] = True
            return done, lengths

    return ReportingController


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
    model: Any = None,
) -> tuple[list[Generated], Timing]:
    """Generate with Megatron's static engine; ``model`` overrides ``stage.model`` (e.g. a
    DeepSpeed-Inference engine wrapping it)."""
    from megatron.core.inference.engines import StaticInferenceEngine
    from megatron.core.inference.inference_request import InferenceRequest
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import (
        GPTInferenceWrapper,
    )
    from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import (
        InferenceWrapperConfig,
    )
    from megatron.core.inference.sampling_params import SamplingParams as MegatronSampling

    reason = engine_supports(params, eos_ids)
    if reason is not None:
        raise ValueError(reason)
    module = model if model is not None else stage.model
    stage.model.config.inference_sampling_seed = params.seed
    eod = next(iter(eos_ids)) if eos_ids else stage.padded_vocab - 1
    wrapper_config = InferenceWrapperConfig(
        hidden_size=stage.arch.hidden_size,
        params_dtype=stage.model.config.params_dtype,
        inference_batch_times_seqlen_threshold=-1,
        padded_vocab_size=stage.padded_vocab,
        inference_max_requests=context.max_batch_size,
        inference_max_seq_length=context.max_sequence_length,
    )
    wrapper = GPTInferenceWrapper(module, wrapper_config, inference_context=context)
    lengths = [len(p) for p in prompts]
    controller = _controller_class(stop, on_token, lengths)(wrapper, _IdTokenizer(eod, stage.arch.vocab_size))
    engine = StaticInferenceEngine(controller, max_batch_size=len(prompts), legacy=True)

    sampling = MegatronSampling(
        temperature=1.0 if params.greedy else params.temperature,
        top_k=1 if params.greedy else params.top_k,
        top_p=0.0 if params.greedy or params.top_p >= 1.0 else params.top_p,
        num_tokens_to_generate=max_new_tokens,
    )
    if not eos_ids:
        sampling.add_attributes({"no_early_termination": True})
    requests = [
        InferenceRequest(request_id=str(i), prompt=" ".join(map(str, p)), prompt_tokens=list(p),
                         sampling_params=sampling)
        for i, p in enumerate(prompts)
    ]
    start = time.perf_counter()
    with torch.inference_mode(), _quiet_progress_bar():
        results = engine.generate(inference_requests=requests)
    end = time.perf_counter()
    first = type(controller).first_step_at or end
    by_id = {str(r.request_id): r for r in results}
    outputs = []
    for i, p in enumerate(prompts):
        res = by_id[str(i)]
        ids = [int(t) for t in res.generated_tokens.tolist()][: int(res.generated_length)]
        out = Generated(list(p), ids)
        if len(ids) < max_new_tokens and eos_ids and not (stop is not None and stop(i, ids)):
            out.token_ids.append(eod)  # Megatron drops the EOD it stopped on; report it like HF
            out.finish_reason = "eos"
        elif stop is not None and ids and stop(i, ids):
            out.finish_reason = "stop"
        else:
            out.finish_reason = "length"
        outputs.append(out)
    # the first token of each row comes out of the prefill; the rest are decode steps
    decoded = sum(max(0, len(o.token_ids) - 1) for o in outputs)
    return outputs, Timing(prefill_s=first - start, decode_s=end - first, decode_tokens=decoded)

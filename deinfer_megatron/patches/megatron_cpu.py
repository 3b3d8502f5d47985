"""CPU shims for Megatron-Core 0.16.1.

Megatron-Core assumes a CUDA device in a handful of places on the inference path, even with
``use_cpu_initialization=True``. Each shim below names the upstream functions it covers and
is installed only on a machine without CUDA: on a GPU machine ``apply()`` patches nothing.
"""

from __future__ import annotations

import logging
import time

import torch

log = logging.getLogger(__name__)

_APPLIED = False


class CpuTimingEvent:
    """Stand-in for ``torch.cuda.Event(enable_timing=True)``.

    Covers the per-step timing events of
    ``TextGenerationController.generate_all_output_tokens_static_batch``: ``record`` reads the
    wall clock, ``elapsed_time`` answers in milliseconds like a CUDA event.
    """

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self._t = 0.0

    def record(self, stream: object = None) -> None:
        self._t = time.perf_counter()

    def synchronize(self) -> None:
        return None

    def wait(self, stream: object = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "CpuTimingEvent") -> float:
        return (end._t - self._t) * 1e3


def _cpu_current_device() -> torch.device:
    """Covers ``torch.cuda.current_device`` used for placement in ``RotaryEmbedding.get_emb``,
    ``Attention._allocate_memory`` (static KV cache), ``GPTModel._preprocess``,
    ``inference.utils.get_attention_mask``, ``TextGenerationController.__init__`` (its sampling
    generator) and ``generate_all_output_tokens_static_batch``, ``_gather_along_last_dim``,
    and the pipeline receive buffers of the inference wrappers."""
    return torch.device("cpu")


def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    """Covers ``megatron.core.transformer.utils.get_default_causal_mask`` (builds on "cuda").

    Deliberately not cached: a mask built under ``torch.inference_mode()`` is an inference
    tensor and could not be reused by a later forward with autograd enabled."""
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _cpu_tensor_cuda(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    """Covers ``Tensor.cuda`` in ``generate_all_output_tokens_static_batch``,
    ``LanguageModule.setup_embeddings_and_output_layer`` (PP > 1, tied embeddings) and
    ``rope_utils.get_pos_emb_on_this_cp_rank``: on CPU the tensor already is where it goes."""
    return self


def _tensor_present(tensor: torch.Tensor | None) -> None:
    """Covers ``inference.communication_utils._is_cuda``, which asserts ``tensor.is_cuda`` in
    ``broadcast_from_last_pipeline_stage``; on CPU only presence can be required."""
    assert tensor is not None, "expected a tensor on the last pipeline stage"


def apply() -> bool:
    """Install the shims when CUDA is absent; return whether they are installed."""
    global _APPLIED
    if _APPLIED:
        return True
    if torch.cuda.is_available():
        return False

    from megatron.core.fusions import fused_softmax
    from megatron.core.inference import communication_utils
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer import utils as mcore_utils

    torch.cuda.current_device = _cpu_current_device  # type: ignore[assignment]
    torch.Tensor.cuda = _cpu_tensor_cuda  # type: ignore[method-assign]
    torch.cuda.Event = CpuTimingEvent  # type: ignore[assignment,misc]
    # Covers the syncs in communication_utils.recv_from_prev_pipeline_rank_ and
    # send_to_next_pipeline_rank (pipeline-parallel inference).
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]

    # fused_softmax imports the function by name, so both bindings are replaced.
    mcore_utils.get_default_causal_mask = _cpu_default_causal_mask
    fused_softmax.get_default_causal_mask = _cpu_default_causal_mask
    communication_utils._is_cuda = _tensor_present

    # Not a monkeypatch: Megatron's own inference RNG tracker, whose fork() is a no-op. Covers
    # get_cuda_rng_tracker().fork() in DotProductAttention.forward and
    # model_parallel_cuda_manual_seed, which read and write the CUDA generator.
    mcore_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)

    _APPLIED = True
    log.debug("Megatron-Core CPU shims applied")
    return True

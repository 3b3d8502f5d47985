"""CPU shims for Megatron-Core 0.16.1.

Megatron-Core assumes a CUDA device in a handful of places that sit on the inference path even
when ``use_cpu_initialization=True``. Each shim below names the upstream function it covers and
only changes behaviour on a machine without CUDA: on a GPU machine ``apply()`` patches nothing.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Iterator

import torch

log = logging.getLogger(__name__)

_APPLIED = False


class CpuRNGStatesTracker:
    """Stand-in for ``megatron.core.tensor_parallel.random.CudaRNGStatesTracker``.

    Covers ``CudaRNGStatesTracker.add``/``fork`` (used by dropout in ``DotProductAttention`` and
    ``LanguageModelEmbedding``, and seeded by ``model_parallel_cuda_manual_seed``), which read and
    write the CUDA generator. Here each named state is a CPU generator state, so a forked region
    draws from its own reproducible stream exactly as on GPU.
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.reset()

    def reset(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._is_initialized = False

    def is_initialized(self) -> bool:
        return self._is_initialized

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise RuntimeError(f"rng seed {seed} already exists")
        if name in self.states_:
            raise RuntimeError(f"rng state {name} already exists")
        self.seeds_.add(seed)
        gen = torch.Generator()
        gen.manual_seed(seed)
        self.states_[name] = gen.get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            # Inference never draws from these streams (dropout is 0); a missing state must not
            # make a CPU run fail where a GPU run with a seeded tracker would not.
            self.add(name, 2718 + len(self.states_))
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)


def _cpu_current_device() -> torch.device:
    """Covers ``torch.cuda.current_device`` as used for placement by Megatron-Core
    (``RotaryEmbedding.get_emb``/``_apply_scaling``, ``DotProductAttention.__init__``,
    ``GPTModel._preprocess``, ``Attention._allocate_memory``)."""
    return torch.device("cpu")


@functools.lru_cache(maxsize=None)
def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    """Covers ``megatron.core.transformer.utils.get_default_causal_mask`` (builds on "cuda")."""
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _cpu_tensor_cuda(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    """Covers ``torch.Tensor.cuda`` as called by ``rope_utils._get_pos_emb_on_this_cp_rank``
    and the static inference controller: on CPU the tensor already is where it must be."""
    return self


def apply() -> bool:
    """Install the shims when CUDA is absent; return whether anything was patched."""
    global _APPLIED
    if _APPLIED:
        return True
    if torch.cuda.is_available():
        return False

    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer import utils as mcore_utils

    torch.cuda.current_device = _cpu_current_device  # type: ignore[assignment]
    torch.Tensor.cuda = _cpu_tensor_cuda  # type: ignore[method-assign]
    # torch.cuda.synchronize: covers the CUDA syncs in
    # TextGenerationController.generate_all_output_tokens_static_batch.
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]

    # fused_softmax imports the function by name, so both bindings are replaced.
    mcore_utils.get_default_causal_mask = _cpu_default_causal_mask
    fused_softmax.get_default_causal_mask = _cpu_default_causal_mask

    # get_cuda_rng_tracker / initialize_rng_tracker: install the CPU tracker once.
    mcore_random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    mcore_random.CudaRNGStatesTracker = CpuRNGStatesTracker

    _APPLIED = True
    log.debug("Megatron-Core CPU shims applied")
    return True

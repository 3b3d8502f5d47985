"""CPU shims for Megatron-Core 0.16.1, each as narrow as the upstream function it covers.

Megatron-Core assumes a CUDA device in a handful of places on the inference path and in its
training schedules, even with ``use_cpu_initialization=True``: it allocates on
``torch.cuda.current_device()`` or with ``torch.zeros(..., device="cuda")``, calls
``Tensor.cuda()``, times steps with ``torch.cuda.Event`` and syncs with
``torch.cuda.synchronize()``. Those five are replaced by CPU stand-ins only *while one of the
covered upstream functions runs* (``COVERED``): each is wrapped so that it runs inside
``cpu_stand_ins()``, and where other Megatron modules imported the function by name, their
references are replaced too. Outside those calls ``torch.cuda`` is torch's own — on a CPU-only
machine ``torch.cuda.current_device()`` still raises — so no other code is misled.

Two upstream helpers are replaced outright because their whole job is CUDA-specific
(``get_default_causal_mask`` builds on "cuda"; ``communication_utils._is_cuda`` asserts
``is_cuda``), and Megatron's own inference RNG tracker is installed. ``apply()`` checks that the
installed Megatron-Core is the version these were read from, and patches nothing where CUDA
is available.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import sys
import threading
import time
from typing import Any, Callable, Iterator

import torch

from deinfer_megatron.patches.versions import require_version

log = logging.getLogger(__name__)

PINNED = "0.16.1"

# (module, attribute path) of every upstream function whose CUDA calls get CPU stand-ins.
COVERED: tuple[tuple[str, str], ...] = (
    # torch.cuda.current_device for placement
    ("megatron.core.models.common.embeddings.rotary_pos_embedding", "RotaryEmbedding.get_emb"),
    ("megatron.core.transformer.attention", "Attention._allocate_memory"),  # static KV cache
    ("megatron.core.models.gpt.gpt_model", "GPTModel._preprocess"),
    ("megatron.core.inference.utils", "get_attention_mask"),
    ("megatron.core.tensor_parallel.mappings", "_gather_along_last_dim"),
    ("megatron.core.utils", "GlobalMemoryBuffer.get_tensor"),  # DotProductAttention's matmul buffer
    # sampling generator; the static batch loop (also Tensor.cuda and torch.cuda.Event timing)
    ("megatron.core.inference.text_generation_controllers.text_generation_controller",
     "TextGenerationController.__init__"),
    ("megatron.core.inference.text_generation_controllers.text_generation_controller",
     "TextGenerationController.generate_all_output_tokens_static_batch"),
    # pipeline-parallel inference: receive buffers, broadcasts, and the syncs after send/recv
    ("megatron.core.inference.model_inference_wrappers.abstract_model_inference_wrapper",
     "AbstractModelInferenceWrapper._allocate_recv_buffer"),
    ("megatron.core.inference.model_inference_wrappers.abstract_model_inference_wrapper",
     "AbstractModelInferenceWrapper.forward_pass_with_pipeline_parallel_large_input_batch"),
    ("megatron.core.inference.communication_utils", "broadcast_from_last_pipeline_stage"),
    ("megatron.core.inference.communication_utils", "recv_from_prev_pipeline_rank_"),
    ("megatron.core.inference.communication_utils", "send_to_next_pipeline_rank"),
    # Tensor.cuda: tied embeddings across pipeline stages; context-parallel RoPE slices
    ("megatron.core.models.common.language_module.language_module",
     "LanguageModule.setup_embeddings_and_output_layer"),
    ("megatron.core.models.common.embeddings.rope_utils", "get_pos_emb_on_this_cp_rank"),
    # training schedules: the token counter is made with torch.zeros(device="cuda"); the
    # pipelined one's send/recv buffers go on torch.cuda.current_device(), then it syncs
    ("megatron.core.pipeline_parallel.schedules", "forward_backward_no_pipelining"),
    ("megatron.core.pipeline_parallel.schedules", "forward_backward_pipelining_without_interleaving"),
    # dist checkpoints: the torch_dist writer's torch.cuda.current_device() for its failure
    # flag and torch.cuda.synchronize() before writing; the loader's synchronize
    ("megatron.core.dist_checkpointing.serialization", "save"),
    ("megatron.core.dist_checkpointing.serialization", "load"),
)

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
    """``torch.cuda.current_device`` for placement: the CPU is where everything lives."""
    return torch.device("cpu")


def _cpu_tensor_cuda(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    """``Tensor.cuda``: on CPU the tensor already is where it goes."""
    return self


def _no_synchronize(*args: object, **kwargs: object) -> None:
    """``torch.cuda.synchronize``: gloo's waits have finished the transfer already."""
    return None


_torch_zeros = torch.zeros


def _cpu_zeros(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
    """``torch.zeros`` whose ``device="cuda"`` means the CPU (the schedules' token counter)."""
    if device is not None and torch.device(device).type == "cuda":
        device = "cpu"
    return _torch_zeros(*args, device=device, **kwargs)


def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    """Replaces ``megatron.core.transformer.utils.get_default_causal_mask`` (builds on "cuda").

    Deliberately not cached: a mask built under ``torch.inference_mode()`` is an inference
    tensor and could not be reused by a later forward with autograd enabled."""
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _tensor_present(tensor: torch.Tensor | None) -> None:
    """Replaces ``inference.communication_utils._is_cuda``, which asserts ``tensor.is_cuda`` in
    ``broadcast_from_last_pipeline_stage``; on CPU only presence can be required."""
    assert tensor is not None, "expected a tensor on the last pipeline stage"


_STAND_INS: tuple[tuple[Any, str, Any], ...] = (
    (torch.cuda, "current_device", _cpu_current_device),
    (torch.Tensor, "cuda", _cpu_tensor_cuda),
    (torch.cuda, "Event", CpuTimingEvent),
    (torch.cuda, "synchronize", _no_synchronize),
    (torch, "zeros", _cpu_zeros),
)
_MISSING = object()  # Tensor.cuda lives on torch._C.TensorBase, not in Tensor's own __dict__
_lock = threading.Lock()
_depth = 0
_saved: list[Any] = []


@contextlib.contextmanager
def cpu_stand_ins() -> Iterator[None]:
    """Within this block ``torch.cuda.current_device``, ``Tensor.cuda``, ``torch.cuda.Event``,
    ``torch.cuda.synchronize`` and ``torch.zeros`` (for ``device="cuda"``) are the CPU stand-ins; torch's own come back when the outermost
    block ends (covered functions call each other, so the block nests)."""
    global _depth
    with _lock:
        if _depth == 0:
            _saved[:] = [owner.__dict__.get(name, _MISSING) for owner, name, _ in _STAND_INS]
            for owner, name, stand_in in _STAND_INS:
                setattr(owner, name, stand_in)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                for (owner, name, _), original in zip(_STAND_INS, _saved):
                    if original is _MISSING:
                        delattr(owner, name)
                    else:
                        setattr(owner, name, original)


def _covered(original: Callable) -> Callable:
    """``original`` running inside ``cpu_stand_ins()``; it keeps a handle on the original."""

    @functools.wraps(original)
    def covered(*args: Any, **kwargs: Any) -> Any:
        with cpu_stand_ins():
            return original(*args, **kwargs)

    covered.__cpu_shim_original__ = original  # type: ignore[attr-defined]
    return covered


def _rebind(original: Any, replacement: Any, name: str) -> None:
    """Where a loaded Megatron module imported ``original`` by name, bind ``replacement``."""
    for mod_name, module in list(sys.modules.items()):
        if mod_name.startswith("megatron.") and getattr(module, name, None) is original:
            setattr(module, name, replacement)


def _cover(module_name: str, path: str) -> None:
    """Wrap ``module.path`` (a function or ``Class.method``) where it is defined and, for a
    function, wherever Megatron imported it by name."""
    module = importlib.import_module(module_name)
    owner_name, _, name = path.rpartition(".")
    owner = getattr(module, owner_name) if owner_name else module
    original = owner.__dict__[name] if owner_name else getattr(module, name)
    assert callable(original), f"{module_name}.{path} is not a function"
    replacement = _covered(original)
    setattr(owner, name, replacement)
    if not owner_name:
        _rebind(original, replacement, name)


def _replace(module_name: str, name: str, replacement: Callable) -> None:
    module = importlib.import_module(module_name)
    original = getattr(module, name)
    setattr(module, name, replacement)
    _rebind(original, replacement, name)


def apply() -> bool:
    """Install the shims when CUDA is absent; return whether they are installed.

    Raises:
        RuntimeError: the installed Megatron-Core is not the version the shims were read from.
    """
    global _APPLIED
    if _APPLIED:
        return True
    if torch.cuda.is_available():
        return False
    require_version("megatron-core", PINNED)

    for module_name, path in COVERED:
        _cover(module_name, path)
    # get_default_causal_mask is imported by name into fused_softmax; both bindings change.
    _replace("megatron.core.transformer.utils", "get_default_causal_mask", _cpu_default_causal_mask)
    _replace("megatron.core.inference.communication_utils", "_is_cuda", _tensor_present)

    # Not a monkeypatch: Megatron's own inference RNG tracker, whose fork() is a no-op. Covers
    # get_cuda_rng_tracker().fork() in DotProductAttention.forward and
    # model_parallel_cuda_manual_seed, which read and write the CUDA generator.
    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)

    _APPLIED = True
    log.debug("Megatron-Core CPU shims applied")
    return True

"""Megatron-Core's import without its fusion compiler, where there is no CUDA.

``megatron.core.jit`` sets ``jit_fuser = torch.compile`` when it is executed, and about twenty
of Megatron's modules decorate functions with it as they are imported (bias-GeLU, GeGLU, SwiGLU
fusions, the MoE and Mamba helpers...). Decorating is not free: each ``torch.compile`` call
imports TorchDynamo and Inductor, ~3 of the ~8 seconds ``import megatron.core`` takes on these
CPUs, paid again by every rank and every command. On a CPU machine no fusion runs (the
project's configs turn them all off, and Inductor's CPU kernels would be compiled per shape),
so this hook applies Megatron's own ``megatron.core.jit.disable_jit_fuser`` right after that
module has been executed and before any module imports the decorator: the functions stay the
plain eager Python functions they wrap, which compute the same values.

``install()`` is called when the ``deinfer_megatron`` package is imported, so it precedes
every import of Megatron the project makes. Where CUDA is available it changes nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any, Sequence

JIT_MODULE = "megatron.core.jit"  # upstream module whose ``jit_fuser`` the decorators read


def _cuda_available() -> bool:
    import torch  # already imported: megatron.core.jit imports it before this runs

    return torch.cuda.is_available()


class _DisableFuserLoader(importlib.abc.Loader):
    """Runs the real loader of ``megatron.core.jit``, then ``disable_jit_fuser()`` without CUDA."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        if not _cuda_available() and callable(getattr(module, "disable_jit_fuser", None)):
            module.disable_jit_fuser()


class _JitFinder(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core.jit`` as the other finders would, with the loader wrapped."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: Any = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname != JIT_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _DisableFuserLoader(spec.loader)
        return spec


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once). When Megatron-Core is already imported
    the decorators have run and there is nothing left to save."""
    if JIT_MODULE in sys.modules or any(isinstance(f, _JitFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _JitFinder())

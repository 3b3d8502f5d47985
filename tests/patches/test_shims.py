"""The CPU shims are version-checked and act only inside the upstream functions they cover.

After ``apply()``, ``torch.cuda`` outside the covered functions is torch's own (on a CPU-only
machine ``current_device()`` raises exactly as before), while the covered functions run with
the CPU stand-ins; the generation parity tests drive the covered paths end to end. The checks
that apply the shims run in a fresh process, so this test process stays as it was.
"""

from __future__ import annotations

import pytest
import torch

from deinfer_megatron.patches import deepspeed_cpu, megatron_cpu
from deinfer_megatron.patches.versions import require_version
from tests.helpers.distributed import run_ranks

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU shims are not applied where CUDA is available")


def _outcome(call) -> tuple[str, str]:
    try:
        return "returned", repr(call())
    except Exception as err:  # torch raises AssertionError or RuntimeError, by build
        return type(err).__name__, str(err)


def _after_apply() -> dict[str, object]:
    """Rank body: how torch.cuda behaves before apply(), after it, and inside covered code."""
    from deinfer_megatron import patches
    from deinfer_megatron.patches.megatron_cpu import cpu_stand_ins

    before = {
        "current_device": _outcome(torch.cuda.current_device),
        "tensor_cuda": _outcome(lambda: torch.zeros(1).cuda()),
    }
    objects = (torch.cuda.current_device, torch.cuda.Event, torch.cuda.synchronize, torch.Tensor.cuda)
    patches.apply_all()
    from megatron.core.inference.model_inference_wrappers.gpt import gpt_inference_wrapper
    from megatron.core.inference.utils import get_attention_mask
    from megatron.core.tensor_parallel import mappings

    mask = get_attention_mask(4)  # covered: allocates on torch.cuda.current_device()
    with cpu_stand_ins():
        with cpu_stand_ins():
            inner = torch.cuda.current_device()
        still = torch.cuda.current_device()
        event = torch.cuda.Event(enable_timing=True)
    try:
        with cpu_stand_ins():
            raise KeyError("inside")
    except KeyError:
        pass
    return {
        "before": before,
        "after_current_device": _outcome(torch.cuda.current_device),
        "after_tensor_cuda": _outcome(lambda: torch.zeros(1).cuda()),
        "objects_unchanged": (torch.cuda.current_device, torch.cuda.Event, torch.cuda.synchronize,
                              torch.Tensor.cuda) == objects,
        "mask": (str(mask.device), tuple(mask.shape)),
        "nested": (str(inner), str(still), type(event).__name__),
        "imported_by_name": gpt_inference_wrapper.get_attention_mask is get_attention_mask,
        "covered": hasattr(get_attention_mask, "__cpu_shim_original__")
        and hasattr(mappings._gather_along_last_dim, "__cpu_shim_original__"),
    }


@cpu_only
def test_torch_cuda_is_torchs_own_outside_the_covered_functions() -> None:
    got = run_ranks(1, _after_apply, timeout=120)[0]
    assert got["before"]["current_device"][0] != "returned"  # a CPU-only torch raises
    assert got["after_current_device"] == got["before"]["current_device"]
    assert got["after_tensor_cuda"] == got["before"]["tensor_cuda"]
    assert got["objects_unchanged"]
    assert got["mask"] == ("cpu", (1, 1, 4, 4))
    assert got["nested"] == ("cpu", "cpu", "CpuTimingEvent")
    assert got["imported_by_name"] and got["covered"]


def test_every_covered_function_exists_upstream() -> None:
    """The names the shims wrap are still there in the installed Megatron-Core."""
    import importlib

    for module_name, path in megatron_cpu.COVERED:
        owner = importlib.import_module(module_name)
        for part in path.split("."):
            owner = getattr(owner, part)
        assert callable(owner), f"{module_name}.{path}"


def test_version_message_names_what_was_found_and_the_fix() -> None:
    require_version("megatron-core", megatron_cpu.PINNED)  # the pinned one is installed
    require_version("deepspeed", deepspeed_cpu.PINNED)
    with pytest.raises(RuntimeError) as err:
        require_version("megatron-core", "0.0.1")
    message = str(err.value)
    assert "\n" not in message
    assert f"megatron-core 0.0.1, but megatron-core {megatron_cpu.PINNED} is installed" in message
    assert "`make install`" in message
    with pytest.raises(RuntimeError, match="no-such-dist is not installed; install the pinned version"):
        require_version("no-such-dist", "1.0")


@cpu_only
def test_shims_refuse_other_versions(monkeypatch) -> None:
    for module, name in ((megatron_cpu, "megatron-core"), (deepspeed_cpu, "deepspeed")):
        monkeypatch.setattr(module, "_APPLIED", False)
        monkeypatch.setattr(module, "PINNED", "0.0.1")
        with pytest.raises(RuntimeError, match=rf"written for {name} 0\.0\.1, but {name} .* is installed"):
            module.apply()

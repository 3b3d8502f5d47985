"""Without CUDA, Megatron-Core is imported without its fusion compiler, and its fused
functions still compute what their formulas say.

Runs in a fresh interpreter (this test process has Megatron imported already): importing the
project and then the Megatron modules the project builds from must leave TorchDynamo and
Inductor unimported, ``jit_fuser`` must be Megatron's own no-op decorator, and the decorated
functions (GeLU with bias, SwiGLU, GeGLU) must equal their formulas written here with
``torch.nn.functional``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the hook changes nothing where CUDA is available")

PROBE = r"""
import json, sys
import torch
import torch.nn.functional as F
import deinfer_megatron
import megatron.core.models.gpt
import megatron.core.jit as jit
from megatron.core.fusions import fused_bias_gelu, fused_bias_geglu, fused_bias_swiglu

torch.manual_seed(0)
y, bias = torch.randn(3, 8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
a, b = torch.chunk(y, 2, -1)
errors = {
    "bias_gelu": (fused_bias_gelu.bias_gelu(bias, y) - F.gelu(y + bias, approximate="tanh")).abs().max().item(),
    "swiglu": (fused_bias_swiglu.swiglu(y) - F.silu(a) * b).abs().max().item(),
    "geglu": (fused_bias_geglu.geglu(y) - F.gelu(a, approximate="tanh") * b).abs().max().item(),
}
print(json.dumps({
    "compiler_modules": sorted(m for m in sys.modules if m.startswith(("torch._dynamo", "torch._inductor"))),
    "fuser": jit.jit_fuser.__name__,
    "errors": errors,
}))
"""


@cpu_only
def test_megatron_is_imported_without_the_fusion_compiler_and_computes_the_same() -> None:
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", PROBE], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["compiler_modules"] == [], got["compiler_modules"][:5]
    assert got["fuser"] == "noop_decorator"
    for name, err in got["errors"].items():
        assert err < 1e-6, (name, err)  # Megatron's constants round sqrt(2/pi) to 8 digits

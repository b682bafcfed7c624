"""The guard of the Triton kernel tests: they run on CUDA, or without it through Triton's CPU interpreter
(TRITON_INTERPRET=1 with triton installed: small shapes, a development aid, not CI)."""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# the dtypes a kernel test runs in: fp32 everywhere, and bf16 (the engine's) on CUDA (the interpreter has no bf16)
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


def require_cuda_or_interpreter() -> None:
    """Call at module level before importing any Triton kernel: skips the module without CUDA (unless the
    interpreter is on) or without triton."""
    if not torch.cuda.is_available() and not INTERPRET:
        pytest.skip("needs CUDA (or TRITON_INTERPRET=1 with triton installed)", allow_module_level=True)
    pytest.importorskip("triton")


def assert_rel_close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    """Same shape and dtype, and the largest difference at most tol of want's largest value."""
    assert got.shape == want.shape and got.dtype == want.dtype
    scale = want.float().abs().amax().clamp(min=1e-6)
    err = float(((got.float() - want.float()).abs() / scale).amax())
    assert err <= tol, err


def seeded_randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Normal values from a CPU generator of `seed` (the same on every device), on DEVICE in `dtype`."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEVICE, dtype)

"""The guard of the Triton kernel tests: they run on CUDA, or without it through Triton's CPU interpreter
(TRITON_INTERPRET=1 with triton installed: small shapes, a development aid, not CI)."""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def require_cuda_or_interpreter() -> None:
    """Call at module level before importing any Triton kernel: skips the module without CUDA (unless the
    interpreter is on) or without triton."""
    if not torch.cuda.is_available() and not INTERPRET:
        pytest.skip("needs CUDA (or TRITON_INTERPRET=1 with triton installed)", allow_module_level=True)
    pytest.importorskip("triton")

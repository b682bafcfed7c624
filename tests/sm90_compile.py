"""Compile Triton kernels for sm_90 (H100 / H200) on a machine without a GPU, through the code that launches them.

`compile_only_for_sm90()` makes Triton's active driver report a CUDA device of capability 9.0 and turns every
`kernel[grid](...)` launch into a compile without a launch (JITFunction's warmup): the real binder specializes
the call's CPU tensors and scalars as it would CUDA ones, the front end and the bundled ptxas build the binary,
nothing runs. So a code path that launches kernels (a precompile, a vocoder call) compiles every variant it
reaches, and a kernel that no longer compiles fails here in CI instead of on the first GPU that runs it. Outputs
are left unwritten: only the compile is checked. Skips where triton is missing or a GPU is present (there the GPU
tests compile and run the same kernels).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.driver import CudaDriver  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

SM90 = GPUTarget("cuda", 90, 32)


class _Sm90Driver(CudaDriver):
    """The CUDA driver's compile-side answers for a device that is not there (no libcuda loaded)."""

    def __init__(self) -> None:  # CudaDriver's own loads libcuda
        pass

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return SM90

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


@contextlib.contextmanager
def compile_only_for_sm90():
    """-> the list of (kernel name, constexpr values) compiled inside the block, in launch order."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the GPU tests compile and run these kernels")
    compiled: list[tuple[str, dict]] = []
    touched: set[JITFunction] = set()
    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        touched.add(self)
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        assert kernel is not None and kernel.asm["cubin"], f"{self.__name__}: no binary"
        compiled.append((self.__name__, {k: v for k, v in kwargs.items() if k.isupper()}))
        return kernel

    saved = driver._active  # None until a real device was asked for: asking here would fail without one
    driver.set_active(_Sm90Driver())
    JITFunction.run = compile_only
    try:
        yield compiled
    finally:
        JITFunction.run = run
        driver._active = saved
        for fn in touched:  # the fake device's entries must not outlive the block
            fn.device_caches.clear()

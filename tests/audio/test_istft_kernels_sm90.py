"""The ISTFT head's Triton kernels (audio/triton_istft.py) compile for sm_90 (H100 / H200) ahead of time, no GPU
needed (Triton's bundled ptxas), and keep the properties their docstrings state: the spectrum's cos and sin are
libdevice's (no .approx instructions: phases reach past pi), and the overlap-add passes a barrier between reading
a slot's old tail and writing its new one. Skipped without triton (the CPU wheel of torch does not bring it)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sm90_compile import SM90  # noqa: E402

from ttsserve.audio import triton_istft  # noqa: E402


def _ptx(fn, signature: dict[str, str], constexprs: dict[str, int]) -> str:
    for name in constexprs:
        signature[name] = "constexpr"
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=SM90)
    assert kernel.asm["cubin"], "no binary"
    return kernel.asm["ptx"]


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_spectrum_kernel_compiles_with_precise_trig(dtype: str) -> None:
    sig = {"x_ptr": f"*{dtype}", "out_ptr": "*fp32"}
    ptx = _ptx(triton_istft._spectrum_kernel, sig, {"N_BINS": 513, "BLOCK": 1024})
    assert "sin.approx" not in ptx and "cos.approx" not in ptx  # hardware approximations: worse past [-pi, pi]


def test_overlap_add_kernel_compiles_with_its_barrier() -> None:
    sig = {n: "*fp32" for n in ("frames_ptr", "window_ptr", "tails_ptr", "out_ptr")}
    sig |= {n: "*i64" for n in ("slots_ptr", "start_ptr", "count_ptr", "limit_ptr")}
    sig |= {"W": "i32", "lag": "i32"}
    ptx = _ptx(triton_istft._overlap_add_kernel, sig, {"HOP": 256, "N_FFT": 1024, "BLOCK": 1024})
    body = ptx[ptx.index(".entry") :]
    barrier = body.index("bar.sync")
    first_store = body.index("st.global")
    assert barrier < first_store, "the old tail must be read before any store to it"
    assert "div.rn.f32" in body  # the division rounded as torch's

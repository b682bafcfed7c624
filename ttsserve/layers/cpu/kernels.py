"""The fused CPU decode kernels (decode_kernels.c): built once per machine with the system C compiler, loaded with
ctypes, called with tensors' data pointers.

Why: between its GEMMs, an eager decode step of the real-size GPT is ~1,000 torch ops (norms, RoPE, the KV
write, the gather + SDPA attention, SiLU, residuals, dtype casts) of 1-3 us each on a small CPU, plus the
attention's gathered fp32 copies of the context. Here each piece between two GEMMs is one call of a few
microseconds, and the attention reads the paged cache in place.

The library is compiled with `$CC` (default `cc`) at `-O3 -march=native` into $TTSSERVE_CACHE (default
~/.cache/ttsserve)/cpu_kernels/, keyed by the source, the flags, the compiler and the CPU's model and flags (a
cache shared by machines must never hand one a library built for another's instructions), so only a machine's
first start pays the ~0.5 s. OpenMP comes from the libgomp torch has already loaded (same soname), so the attention's
parallel loop shares torch's thread team. No compiler, a failed build, or $TTSSERVE_CPU_KERNELS=0: `load()`
returns None and the caller keeps the torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_kernels.c")
ENV = "TTSSERVE_CPU_KERNELS"  # "0": never build or use the kernels
FLAGS = [
    "-O3",
    "-march=native",
    *(["-mprefer-vector-width=512"] if platform.machine() in ("x86_64", "AMD64") else []),  # 16-float vectors
    "-ffp-contract=off",  # no FMA: torch rounds a * b and + c separately
    "-fno-trapping-math",  # (no effect on results) lets floorf / selects vectorize
    "-fno-math-errno",
    "-fopenmp",
    "-shared",
    "-fPIC",
]


def fits(num_heads: int, head_dim: int) -> bool:
    """The attention kernel's shape limits: 16-float vectors per head, one task's heads on the stack."""
    return head_dim % 16 == 0 and head_dim <= 512 and num_heads <= 64 and num_heads * head_dim <= 4096


_P, _I, _F, _B = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int  # _B: the C `int` flags
_SIGNATURES = {
    "add_rms_norm": [_P, _B, _P, _B, _P, _I, _I, _F, _P, _B],
    "silu_mul": [_P, _B, _I, _I, _P, _B, _B],
    "decode_attention": [_P, _B, _P, _P, _P, _P, _B, _P, _P, _I, _P, _I, _I, _I, _I, _I, _F, _P, _B, _B, _P, _I],
}
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def _cache_dir() -> Path:
    return Path(os.environ.get("TTSSERVE_CACHE") or Path.home() / ".cache" / "ttsserve") / "cpu_kernels"


def _cpu_identity() -> str:
    """The first CPU's model name and instruction-set flags (-march=native targets them), or the platform's
    description where /proc/cpuinfo is missing."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    wanted = ("model name", "flags", "Features", "CPU part")  # x86, then arm
    return "\n".join(dict.fromkeys(ln for ln in lines if ln.split(":")[0].strip() in wanted))


def _build(cc: str) -> Path:
    """Compile (or find) the library for this source, compiler, flag set and CPU; returns its path."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    parts = [SOURCE.read_text(), version, _cpu_identity(), *FLAGS]
    lib = _cache_dir() / f"decode_kernels-{hashlib.sha256(chr(0).join(parts).encode()).hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:  # build aside, rename: concurrent starts are safe
        out = Path(tmp) / lib.name
        subprocess.run([cc, *FLAGS, "-o", str(out), str(SOURCE), "-lm"], check=True, capture_output=True, timeout=120)
        os.replace(out, lib)
    logger.info("CPU decode kernels built in %.1f s: %s", time.perf_counter() - t0, lib)
    return lib


@functools.cache
def load() -> CpuDecodeKernels | None:
    """The kernels for this machine, built on first use; None when they are off or cannot be built."""
    if os.environ.get(ENV, "1") == "0":
        return None
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        logger.info("CPU decode kernels: no C compiler (%s); the decode step runs as torch ops", cc)
        return None
    try:
        lib = ctypes.CDLL(str(_build(cc)))
    except (OSError, subprocess.SubprocessError) as e:
        stderr = (getattr(e, "stderr", b"") or b"").decode(errors="replace").strip().splitlines()
        logger.warning(
            "CPU decode kernels: build failed (%s: %s); the decode step runs as torch ops",
            type(e).__name__,
            stderr[0] if stderr else e,
        )
        return None
    return CpuDecodeKernels(lib)


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def _is_bf16(t: torch.Tensor) -> int:
    return int(t.dtype == torch.bfloat16)


def attention_scratch(scores: torch.Tensor | None, num_heads: int, max_seq_len: int) -> torch.Tensor:
    """`scores` if it fits, else a bigger one: [threads, >= num_heads * max_seq_len] fp32, a row of attention
    scores (heads x context) per OpenMP thread. Its owner keeps it (one per engine: calls must not share it)."""
    rows, length = torch.get_num_threads(), num_heads * max_seq_len
    if scores is not None and scores.shape[0] >= rows and scores.shape[1] >= length:
        return scores
    old_rows, old_len = (0, 0) if scores is None else scores.shape
    return torch.empty(max(rows, old_rows), max(length, 1 << 14, 2 * old_len))


class CpuDecodeKernels:
    """Typed wrappers of the library's three functions (stateless: shared by every engine of the process).
    Every tensor must be contiguous, on the CPU, fp32 or bf16 (checked by the callers once per step, not here:
    these run ~80 times a step)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, None
        self._add_rms_norm, self._silu_mul = lib.add_rms_norm, lib.silu_mul
        self._attention = lib.decode_attention

    def add_rms_norm(
        self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, out: torch.Tensor
    ) -> torch.Tensor:
        """h += delta (rounded to h's dtype), then out = weight * rms_norm(h). h: [T, H] in the model dtype,
        modified in place; delta: [T, H] fp32 / bf16 or None; weight: [H] in h's dtype; out: [T, H]."""
        t, hidden = h.shape
        self._add_rms_norm(
            _ptr(h),
            _is_bf16(h),
            None if delta is None else _ptr(delta),
            0 if delta is None else _is_bf16(delta),
            _ptr(weight),
            t,
            hidden,
            eps,
            _ptr(out),
            _is_bf16(out),
        )
        return out

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor, round_bf16: bool) -> torch.Tensor:
        """gate_up [T, 2I] -> out [T, I] = silu(gate) * up (rounded to bf16 after each op when round_bf16)."""
        t, i2 = gate_up.shape
        self._silu_mul(_ptr(gate_up), _is_bf16(gate_up), t, i2 // 2, _ptr(out), _is_bf16(out), int(round_bf16))
        return out

    def decode_attention(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        num_heads: int,
        scale: float,
        out: torch.Tensor,
        round_bf16: bool,
        scores: torch.Tensor,
    ) -> torch.Tensor:
        """RoPE, the KV write and one-token attention of B sequences (attention/torch_ref.py's decode path).

        qkv: [B, (Hq + 2 Hkv) D]; cos / sin: [B, D] fp32; kv_cache: [2, num_blocks, block_size, Hkv, D] (fp32 /
        bf16), written at slots [B] int64; block_tables: [B, W] int32; seq_lens: [B] int32 (context incl. the
        new token); out: [B, Hq D]; scores: attention_scratch(.., num_heads, max(seq_lens))."""
        _, num_blocks, block_size, hkv, d = kv_cache.shape
        self._attention(
            _ptr(qkv),
            _is_bf16(qkv),
            _ptr(cos),
            _ptr(sin),
            _ptr(kv_cache),
            _ptr(kv_cache) + kv_cache.stride(0) * kv_cache.element_size(),
            _is_bf16(kv_cache),
            _ptr(slots),
            _ptr(block_tables),
            block_tables.stride(0),
            _ptr(seq_lens),
            qkv.shape[0],
            num_heads,
            hkv,
            d,
            block_size,
            scale,
            _ptr(out),
            _is_bf16(out),
            int(round_bf16),
            _ptr(scores),
            scores.stride(0),
        )
        return out

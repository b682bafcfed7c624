"""Capability probes of the machine (CPU instruction sets), shared by model/, audio/ and runner/."""

from __future__ import annotations

import torch


def cpu_has_native_bf16() -> bool:
    """AVX512_BF16 or AMX-BF16 (oneDNN's fast bf16 paths)."""
    cpu = getattr(torch, "cpu", None)
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(cpu, name, lambda: False)() for name in checks)

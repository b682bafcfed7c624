"""The vocoder's fusions are on unless TTSSERVE_VOCODER_FUSED=0, which turns both off (read at import, in the
engine core's process as in any other)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

PROBE = (
    "import importlib.util\n"
    "from ttsserve.audio import incremental\n"
    "flags = [incremental.TRITON_ISTFT]\n"
    "if importlib.util.find_spec('triton'):\n"
    "    from ttsserve.audio import triton_convnext\n"
    "    flags.append(triton_convnext.GELU_EPILOGUE)\n"
    "print(' '.join(map(str, flags)))\n"
)


def _flags(value: str | None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "TTSSERVE_VOCODER_FUSED"}
    if value is not None:
        env["TTSSERVE_VOCODER_FUSED"] = value
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return out.stdout.split()


@pytest.mark.parametrize(("value", "expected"), [(None, "True"), ("0", "False"), ("1", "True")])
def test_fused_switch(value: str | None, expected: str) -> None:
    flags = _flags(value)
    assert flags and set(flags) == {expected}, flags
    if importlib.util.find_spec("triton") is None:
        assert len(flags) == 1  # triton_convnext needs triton: only the ISTFT switch is read here

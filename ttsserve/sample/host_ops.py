"""CPU versions of the sampler's two costliest steps, in numpy, bitwise equal to their torch forms.

On a CPU the sampler is a large part of a decode step of a small model (tiny model, one thread, 16 rows of 4
codebooks over 626 codes): torch's stable sort of the [64, 626] logits took 1.6 ms and the hash RNG's ~60
small int64 ops 0.5-0.8 ms, about half the step. The same results:
- `stable_sort_last`: numpy's AVX-512 sort of int64 keys (an order-preserving int of the float, then the
  column index), ~10x faster than torch.sort(stable=True); unique keys make any sort a stable one;
- `hash_uniform_host`: the counter-based hash of sample/rng.py in uint32 numpy arithmetic (a uint32 product
  wraps mod 2**32, which is what rng._mul32 computes in int64), in place, ~2.5x faster.
The CUDA path keeps the torch forms (graph-capturable, no host round trip); tests/sample checks equality.
"""

from __future__ import annotations

import numpy as np
import torch

from ttsserve.sample.rng import _GOLDEN, _ROW_SALT, _STEP_SALT

_U32 = np.uint32
_LOW31 = np.int32(0x7FFFFFFF)
_LOW32 = np.int64(0xFFFFFFFF)


def stable_sort_last(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.sort(x, dim=-1, stable=True) for an fp32 CPU tensor [..., V] (V < 2**32): (values, indices int64).

    Key of an element: its fp32 bits as an int32 with the low 31 bits flipped for negatives (integer order
    = float order), -0.0 read as +0.0 and every NaN as one NaN above +inf (torch's order: they tie with
    +0.0 / each other and keep their index order), shifted up 32 bits, plus the column index."""
    xn = x.detach().contiguous().numpy()
    y = xn + np.float32(0.0)  # -0.0 + 0.0 = +0.0
    nan = np.isnan(y)
    if nan.any():
        y[nan] = np.float32(np.nan)
    bits = y.view(np.int32)
    bits ^= (bits >> 31) & _LOW31
    keys = bits.astype(np.int64)
    keys <<= 32
    keys |= np.arange(xn.shape[-1], dtype=np.int64)
    keys.sort(axis=-1)
    keys &= _LOW32
    idx = torch.from_numpy(keys)
    return torch.from_numpy(xn).gather(-1, idx), idx  # (torch's gather: 5x numpy's take_along_axis here)


def _mix32_(x: np.ndarray) -> np.ndarray:
    """rng.mix32 on a uint32 array, in place."""
    x ^= x >> _U32(16)
    x *= _U32(0x7FEB352D)
    x ^= x >> _U32(15)
    x *= _U32(0x846CA68B)
    x ^= x >> _U32(16)
    return x


def _stream_keys(seeds: np.ndarray, steps: np.ndarray, num_rows: int) -> np.ndarray:
    """rng.stream_keys: seeds, steps [B] int64 -> [B, num_rows] uint32."""
    h = _mix32_((seeds & _LOW32).astype(_U32) ^ _U32(_GOLDEN))
    h = _mix32_(h ^ ((seeds >> 32) & _LOW32).astype(_U32))
    h = _mix32_(h ^ (steps & _LOW32).astype(_U32) * _U32(_STEP_SALT))
    rows = (np.arange(num_rows, dtype=_U32) + _U32(1)) * _U32(_ROW_SALT)
    return _mix32_(h[:, None] ^ rows[None, :])


def hash_uniform_host(seeds: torch.Tensor, steps: torch.Tensor, num_rows: int, vocab_size: int) -> torch.Tensor:
    """rng.hash_uniform for CPU tensors: seeds, steps [B] int -> u [B, num_rows, vocab_size] fp32 in (0, 1)."""
    keys = _stream_keys(seeds.long().numpy(), steps.long().numpy(), num_rows)
    h = keys[:, :, None] ^ np.arange(vocab_size, dtype=_U32)[None, None, :]
    _mix32_(h)
    h ^= _U32(_GOLDEN)
    _mix32_(h)
    h >>= _U32(9)
    u = h.astype(np.float32)
    u += np.float32(0.5)
    u *= np.float32(2.0**-23)
    return torch.from_numpy(u)

"""Speaker embeddings and audio prompts as strings (MODEL.md §2.7).

Formats (all little-endian):
- `spk_stat`: base16384( fp16[2*dim] ) = std[dim] ++ mean[dim] (the random-speaker table).
- `spk_emb`:  base16384( raw LZMA2 preset 9|EXTREME ( fp16[dim] ) ).
- `spk_smp`:  base16384( uint16[2] shape (num_vq, T) ++ raw LZMA2 preset 9|EXTREME ( uint16[num_vq, T] ) ).
"""

from __future__ import annotations

import lzma
import math

import numpy as np

from ttsserve.text import base16384

_LZMA_FILTERS = [{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME}]
# Decoding needs a dictionary only as large as the payload; the preset's 64 MiB would cost ~1 ms per
# decode in allocation. 1 MiB covers the largest legal payload (spk_smp: 4 x 65535 uint16 = 512 KiB) and
# doubles as the cap against decompression bombs.
_MAX_PAYLOAD = 1 << 20
_LZMA_DECODE_FILTERS = [{"id": lzma.FILTER_LZMA2, "dict_size": _MAX_PAYLOAD}]
NUM_VQ = 4


def _compress(raw: bytes) -> bytes:
    return lzma.compress(raw, format=lzma.FORMAT_RAW, filters=_LZMA_FILTERS)


def _decompress(blob: bytes, what: str) -> bytes:
    dec = lzma.LZMADecompressor(format=lzma.FORMAT_RAW, filters=_LZMA_DECODE_FILTERS)
    try:
        out = dec.decompress(blob, max_length=_MAX_PAYLOAD + 1)
    except lzma.LZMAError as e:
        raise ValueError(f"{what}: the payload is not raw LZMA2 data ({e})") from None
    if len(out) > _MAX_PAYLOAD:
        raise ValueError(f"{what}: the payload decompresses to more than {_MAX_PAYLOAD} bytes")
    if not dec.eof:
        raise ValueError(f"{what}: the LZMA2 payload is truncated")
    return out


def _b16384_decode(s: str, what: str) -> bytes:
    if not isinstance(s, str) or not s.strip():
        raise ValueError(f"{what}: expected a non-empty base16384 string")
    try:
        return base16384.decode(s)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None


# ---- speaker embedding ----------------------------------------------------------------------------


def decode_speaker(s: str, dim: int | None = None) -> np.ndarray:
    """`spk_emb` string -> fp16 [dim]. ValueError if malformed, non-finite, or not `dim` long."""
    raw = _decompress(_b16384_decode(s, "spk_emb"), "spk_emb")
    if len(raw) == 0 or len(raw) % 2:
        raise ValueError(f"spk_emb: decoded {len(raw)} bytes, expected a whole number of fp16 values")
    vec = np.frombuffer(raw, dtype="<f2").astype(np.float16)
    if dim is not None and vec.shape[0] != dim:
        raise ValueError(f"spk_emb: has {vec.shape[0]} values, the model needs {dim}")
    if not np.isfinite(vec).all():
        raise ValueError("spk_emb: contains non-finite values")
    return vec


def encode_speaker(vec: np.ndarray) -> str:
    """fp16 [dim] (any float array is cast to fp16) -> `spk_emb` string; inverse of `decode_speaker`."""
    arr = np.asarray(vec)
    if arr.ndim != 1 or arr.shape[0] == 0:
        raise ValueError(f"speaker vector must be 1-D and non-empty, got shape {arr.shape}")
    return base16384.encode(_compress(arr.astype("<f2").tobytes()))


def decode_spk_stat(s: str) -> tuple[np.ndarray, np.ndarray]:
    """`spk_stat` string -> (std fp16 [dim], mean fp16 [dim])."""
    raw = _b16384_decode(s, "spk_stat")
    if len(raw) == 0 or len(raw) % 4:
        raise ValueError(f"spk_stat: decoded {len(raw)} bytes, expected 2*dim fp16 values")
    stat = np.frombuffer(raw, dtype="<f2").astype(np.float16)
    dim = stat.shape[0] // 2
    return stat[:dim].copy(), stat[dim:].copy()


def encode_spk_stat(std: np.ndarray, mean: np.ndarray) -> str:
    """(std fp16 [dim], mean fp16 [dim]) -> `spk_stat` string (uncompressed); inverse of `decode_spk_stat`."""
    std, mean = np.asarray(std), np.asarray(mean)
    if std.ndim != 1 or std.shape != mean.shape or std.shape[0] == 0:
        raise ValueError(f"std and mean must be 1-D of equal non-zero length, got {std.shape} and {mean.shape}")
    return base16384.encode(np.concatenate([std, mean]).astype("<f2").tobytes())


def normalize_speaker(vec: np.ndarray) -> np.ndarray:
    """What replaces the [spk_emb] embedding: `F.normalize(vec, dim=0, eps=1e-12)` computed in fp16."""
    import torch  # lazy: keeps this module importable without torch

    t = torch.from_numpy(np.asarray(vec, dtype=np.float16).copy())
    return torch.nn.functional.normalize(t, p=2.0, dim=0, eps=1e-12).numpy()


# ---- random speaker -------------------------------------------------------------------------------


def sample_random_speaker(std: np.ndarray, mean: np.ndarray, seed: int) -> np.ndarray:
    """The reference's random speaker: `torch.manual_seed(seed); torch.randn(dim, fp16) * std + mean`
    on CPU, bit-exact as computed by torch 2.9 (the version the reference goldens were made with).

    Returns fp16 [dim]. Needs dim >= 16 (the reference sizes are 64 and 768).

    Why not call torch: CPU fp16 `randn` changed in later torch releases (2.13 draws 24-bit uniforms
    and computes Box-Muller in fp32), so the same seed gives a different speaker there. We replay the
    torch 2.9 algorithm on the same MT19937 stream instead (`_randn_fp16_torch29`).
    """
    std = np.asarray(std, dtype=np.float16)
    mean = np.asarray(mean, dtype=np.float16)
    if std.ndim != 1 or std.shape != mean.shape:
        raise ValueError(f"std and mean must be 1-D of equal length, got {std.shape} and {mean.shape}")
    z = _randn_fp16_torch29(std.shape[0], seed)
    # fp16 mul_ then add_: each op computed in fp32 and rounded to fp16, as torch does on CPU.
    x = (z.astype(np.float32) * std.astype(np.float32)).astype(np.float16)
    return (x.astype(np.float32) + mean.astype(np.float32)).astype(np.float16)


def _h(x: np.ndarray) -> np.ndarray:
    """A C++ float result stored into a c10::Half: round to fp32 first, then to fp16."""
    return np.asarray(x, dtype=np.float64).astype(np.float32).astype(np.float16)


def _mt19937_uint32(seed: int, n: int) -> np.ndarray:
    """The first n 32-bit outputs of torch's CPU generator after `torch.manual_seed(seed)`.

    torch seeds a standard MT19937 with the low 32 bits of the seed, exactly like numpy's legacy
    `RandomState(seed)`; a full-range uint32 `randint` returns the raw outputs in order.
    """
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    rs = np.random.RandomState(seed & 0xFFFFFFFF)
    return rs.randint(0, 2**32, size=n, dtype=np.uint64)


def _box_muller16(u: np.ndarray) -> np.ndarray:
    """torch 2.9 `normal_fill_16` for Half (mean 0, std 1): u fp16 [k, 16] uniforms -> fp16 [k, 16].

    Every intermediate is a c10::Half, so every math call and product is rounded to fp16.
    """
    u1 = _h(1.0 - u[:, :8].astype(np.float64))  # [0,1) -> (0,1] for the log
    u2 = u[:, 8:].astype(np.float64)
    log_u1 = _h(np.log(u1.astype(np.float64)))
    radius = _h(np.sqrt(_h(-2.0 * log_u1.astype(np.float64)).astype(np.float64)))
    theta = _h(2.0 * math.pi * u2).astype(np.float64)
    r = radius.astype(np.float64)
    # `* std + mean` with std=1, mean=0 is kept: `+ 0` turns -0.0 (from u1 == 1) into +0.0.
    lo = _h(_h(r * _h(np.cos(theta)).astype(np.float64)).astype(np.float64) + 0.0)
    hi = _h(_h(r * _h(np.sin(theta)).astype(np.float64)).astype(np.float64) + 0.0)
    return np.concatenate([lo, hi], axis=1)


def _randn_fp16_torch29(dim: int, seed: int) -> np.ndarray:
    """`torch.manual_seed(seed); torch.randn(dim, dtype=torch.float16)` on CPU as in torch 2.9 -> fp16 [dim].

    Uniforms are c10::Half `uniform_real(0, 1)`: the low 11 bits of each 32-bit draw / 2048. Blocks of 16
    go through Box-Muller; when dim % 16 != 0 the last 16 values are redrawn from 16 fresh uniforms.
    """
    if dim < 16:
        raise ValueError(f"speaker dim must be >= 16, got {dim}")
    tail = dim % 16
    draws = _mt19937_uint32(seed, dim + (16 if tail else 0))
    u = ((draws & 2047).astype(np.float64) / 2048.0).astype(np.float16)
    full = dim - tail
    out = np.empty(dim, dtype=np.float16)
    out[:full] = _box_muller16(u[:full].reshape(-1, 16)).reshape(-1)
    if tail:
        # The reference then recomputes the last 16 positions (overlapping the last whole block) from
        # 16 fresh draws.
        out[dim - 16 :] = _box_muller16(u[dim:].reshape(1, 16)).reshape(-1)
    return out


# ---- audio prompt (spk_smp) -----------------------------------------------------------------------


def encode_audio_prompt(codes: np.ndarray) -> str:
    """Audio-prompt codes int [num_vq, T] -> `spk_smp` string."""
    arr = np.asarray(codes)
    if arr.ndim != 2 or arr.shape[1] == 0 or arr.shape[0] == 0:
        raise ValueError(f"audio prompt codes must be [num_vq, T] with T > 0, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"audio prompt codes must be integers, got {arr.dtype}")
    if arr.min() < 0 or arr.max() > 0xFFFF or max(arr.shape) > 0xFFFF:
        raise ValueError("audio prompt codes and sizes must fit in uint16")
    header = np.array(arr.shape, dtype="<u2").tobytes()
    return base16384.encode(header + _compress(arr.astype("<u2").tobytes()))


def decode_audio_prompt(s: str, num_vq: int = NUM_VQ, num_codes: int | None = None) -> np.ndarray:
    """`spk_smp` string -> int32 [num_vq, T]. ValueError if malformed, of another num_vq, or if a
    code is >= num_codes (when given, e.g. 625 to reject EOS and out-of-vocabulary codes)."""
    raw = _b16384_decode(s, "spk_smp")
    if len(raw) < 5:
        raise ValueError(f"spk_smp: decoded only {len(raw)} bytes")
    q, t = (int(x) for x in np.frombuffer(raw[:4], dtype="<u2"))
    if q != num_vq or t == 0:
        raise ValueError(f"spk_smp: header shape ({q}, {t}), expected ({num_vq}, T > 0)")
    payload = _decompress(raw[4:], "spk_smp")
    if len(payload) != 2 * q * t:
        raise ValueError(f"spk_smp: payload has {len(payload)} bytes, shape ({q}, {t}) needs {2 * q * t}")
    codes = np.frombuffer(payload, dtype="<u2").reshape(q, t).astype(np.int32)
    if num_codes is not None and codes.max() >= num_codes:
        raise ValueError(f"spk_smp: code {int(codes.max())} is out of range [0, {num_codes})")
    return codes

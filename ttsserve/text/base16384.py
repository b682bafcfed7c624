"""base16384: bytes <-> a string of CJK characters, 14 bits per character (MODEL.md §2.7).

Our own implementation of the format (the `pybase16384` package is GPLv3):
- every 7 input bytes are a 56-bit big-endian integer written as four 14-bit values, most significant
  first, each as the character U+4E00 + value;
- a final partial group of r bytes (1..6) is zero-padded to 7 bytes and emits ceil(8r/14) characters,
  followed by the terminator character U+3D00 + r.
"""

from __future__ import annotations

_BASE = 0x4E00  # first data character
_TERM = 0x3D00  # terminator U+3D00 + r marks a final group of r bytes
_GROUP = 7  # bytes per group (56 bits = 4 x 14)


def encode(data: bytes) -> str:
    """Bytes -> base16384 string."""
    data = bytes(data)
    full = len(data) - len(data) % _GROUP
    out: list[str] = []
    for i in range(0, full, _GROUP):
        out.extend(_group_chars(data[i : i + _GROUP], 4))
    r = len(data) - full
    if r:
        padded = data[full:] + bytes(_GROUP - r)
        out.extend(_group_chars(padded, -(-8 * r // 14)))
        out.append(chr(_TERM + r))
    return "".join(out)


def _group_chars(group: bytes, n: int) -> list[str]:
    v = int.from_bytes(group, "big")
    return [chr(_BASE + ((v >> (42 - 14 * k)) & 0x3FFF)) for k in range(n)]


def decode(s: str) -> bytes:
    """base16384 string -> bytes; ValueError on characters outside the alphabet or a bad tail."""
    if not isinstance(s, str):
        raise ValueError(f"base16384 input must be a str, got {type(s).__name__}")
    s = s.strip()
    r = 0
    if s and _TERM + 1 <= ord(s[-1]) <= _TERM + 6:
        r = ord(s[-1]) - _TERM
        s = s[:-1]
    values = []
    for pos, ch in enumerate(s):
        v = ord(ch) - _BASE
        if not 0 <= v < 0x4000:
            raise ValueError(f"base16384: invalid character {ch!r} (U+{ord(ch):04X}) at position {pos}")
        values.append(v)
    tail = -(-8 * r // 14) if r else 0
    if len(values) < tail or (len(values) - tail) % 4:
        raise ValueError(f"base16384: {len(values)} data characters do not match a tail of {r} bytes")
    out = bytearray()
    full = len(values) - tail
    for i in range(0, full, 4):
        out += _values_bytes(values[i : i + 4])
    if r:
        out += _values_bytes(values[full:])[:r]
    return bytes(out)


def _values_bytes(vals: list[int]) -> bytes:
    v = 0
    for k in range(4):
        v = (v << 14) | (vals[k] if k < len(vals) else 0)
    return v.to_bytes(_GROUP, "big")

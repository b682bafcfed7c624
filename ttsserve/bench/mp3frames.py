"""Samples in a streamed MP3, counted from its frame headers (no decoding): how `bench serve` times mp3 streams.

Every MPEG audio Layer III frame carries a fixed number of samples (1152 in MPEG-1, 576 in MPEG-2 / 2.5, which
is what 24 kHz uses) and its length follows from its header. Counting frames as they arrive gives each chunk's
audio duration at a cost of a few operations per frame, where decoding 1,000 audio-seconds per second would
need several cores of the machine under test. The count includes the encoder's delay and end padding (about two
frames per stream), so it reads a little high; an ID3v2 tag and a Xing / Info header frame are skipped.
"""

from __future__ import annotations

_BITRATES_KBPS = {  # Layer III
    1: (0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320),
    2: (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),
}
_SAMPLE_RATES = {3: (44100, 48000, 32000), 2: (22050, 24000, 16000), 0: (11025, 12000, 8000)}  # by version bits


def frame_info(header: bytes) -> tuple[int, int] | None:
    """(frame length in bytes, samples) of the Layer III frame whose 4-byte header this is, else None."""
    if len(header) < 4 or header[0] != 0xFF or header[1] & 0xE0 != 0xE0:
        return None
    version, layer = (header[1] >> 3) & 3, (header[1] >> 1) & 3
    bitrate_index, rate_index, padding = header[2] >> 4, (header[2] >> 2) & 3, (header[2] >> 1) & 1
    if version == 1 or layer != 1 or bitrate_index in (0, 15) or rate_index == 3:
        return None  # reserved version, not Layer III, free / bad bitrate, reserved rate
    mpeg1 = version == 3
    kbps = _BITRATES_KBPS[1 if mpeg1 else 2][bitrate_index]
    rate = _SAMPLE_RATES[version][rate_index]
    length = (144 if mpeg1 else 72) * kbps * 1000 // rate + padding
    return length, 1152 if mpeg1 else 576


class Mp3FrameCounter:
    """feed(bytes) -> samples in the frames completed by these bytes (a stream's chunks, in order)."""

    def __init__(self) -> None:
        self._buf = b""
        self._first = True
        self.frames = 0

    def feed(self, data: bytes) -> int:
        self._buf += data
        buf, pos, samples = self._buf, 0, 0
        if self._first and buf.startswith(b"ID3"):
            if len(buf) < 10:
                return 0
            size = (buf[6] << 21) | (buf[7] << 14) | (buf[8] << 7) | buf[9]  # syncsafe integer
            if len(buf) < 10 + size:
                return 0
            pos = 10 + size
        while len(buf) - pos >= 4:
            info = frame_info(buf[pos : pos + 4])
            if info is None:
                pos += 1  # not at a frame boundary (junk between frames): resynchronise
                continue
            length, n = info
            if len(buf) - pos < length:
                break
            frame = buf[pos : pos + length]
            if not (self._first and (b"Xing" in frame[:64] or b"Info" in frame[:64])):
                samples += n
                self.frames += 1
            self._first = False
            pos += length
        self._buf = buf[pos:]
        return samples

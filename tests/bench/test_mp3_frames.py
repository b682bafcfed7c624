"""MP3 frame counting (bench/mp3frames.py) against the project's own streaming mp3 encoder."""

import numpy as np
import pytest

from ttsserve.audio.encode import StreamingEncoder
from ttsserve.bench.mp3frames import Mp3FrameCounter, frame_info


@pytest.mark.parametrize("seconds", [0.5, 3.0])
def test_counted_samples_match_the_encoded_duration(seconds):
    n = int(24000 * seconds)
    wav = (0.3 * np.sin(np.arange(n) * 0.05)).astype(np.float32)
    enc = StreamingEncoder("mp3", 24000)
    data = b"".join(enc.write(wav[i : i + 2400]) for i in range(0, n, 2400)) + enc.close()
    whole = Mp3FrameCounter().feed(data)
    counter = Mp3FrameCounter()
    split = sum(counter.feed(data[i : i + 333]) for i in range(0, len(data), 333))  # odd chunk boundaries
    assert split == whole
    assert n <= whole <= n + 4 * 576  # the encoder's delay and padding: a few frames more, never fewer


def test_headers():
    assert frame_info(bytes([0xFF, 0xF3, 0x84, 0xC4])) == (72 * 64000 // 24000, 576)  # MPEG-2 L3 64 kbps 24 kHz
    assert frame_info(bytes([0xFF, 0xFB, 0x90, 0x00])) == (144 * 128000 // 44100, 1152)  # MPEG-1 L3 128k 44.1k
    assert frame_info(b"\x00\x00\x00\x00") is None and frame_info(bytes([0xFF, 0xFB, 0xF0, 0])) is None
    assert Mp3FrameCounter().feed(b"garbage without frames") == 0

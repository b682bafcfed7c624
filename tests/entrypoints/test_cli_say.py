"""`ttsserve say` end to end in a subprocess (tiny dummy model)."""

import subprocess
import sys

import numpy as np
import soundfile as sf

from tests.tiny_args import TINY_CLI_ARGS

BASE = [
    sys.executable,
    "-m",
    "ttsserve.entrypoints.cli",
    "say",
    *TINY_CLI_ARGS,
    "--skip-refine",
    "--min-new-tokens",
    "20",
    "--max-new-tokens",
    "20",
]


def _say(tmp_path, name, *extra):
    out = tmp_path / name
    proc = subprocess.run(
        BASE + ["Hello world. 今天是2024年5月1日。", "-o", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return out, proc


def test_say_writes_audio_and_is_reproducible(tmp_path):
    a, proc = _say(tmp_path, "a.wav", "--seed", "5", "--speaker", "seed:3")
    b, _ = _say(tmp_path, "b.wav", "--seed", "5", "--speaker", "seed:3")
    wav_a, sr = sf.read(a, dtype="float32")
    wav_b, _ = sf.read(b, dtype="float32")
    assert sr == 24000
    assert wav_a.size == 512 * 20 - 256  # a short text stays one segment: 20 frames
    np.testing.assert_array_equal(wav_a, wav_b)
    assert "frames" in proc.stdout and "RANDOM weights" in proc.stderr


def test_say_other_format_and_bad_input(tmp_path):
    out, _ = _say(tmp_path, "c.flac", "--seed", "1")
    wav, sr = sf.read(out, dtype="float32")
    assert sr == 24000 and wav.size > 0
    bad = subprocess.run(
        BASE + ["hi", "-o", str(tmp_path / "d.wav"), "--top-p", "2"], capture_output=True, text=True, timeout=300
    )
    assert bad.returncode == 2 and "top_p" in bad.stderr


def test_say_refuses_to_write_an_empty_file(tmp_path):
    from tests.eos_testutil import eos_at_once_checkpoint

    model = eos_at_once_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "empty.wav"
    cmd = [
        sys.executable,
        "-m",
        "ttsserve.entrypoints.cli",
        "say",
        "Hello.",
        "-o",
        str(out),
        "--model",
        str(model),
        "--device",
        "cpu",
        "--skip-refine",
        "--seed",
        "1",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert "error: the model produced no audio (EOS at the first step)" in proc.stderr and not out.exists()

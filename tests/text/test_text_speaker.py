"""base16384, speaker embeddings, the random-speaker sampler and audio prompts (b_speaker, e, f goldens)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ttsserve.text import base16384
from ttsserve.text.speaker import (
    decode_audio_prompt,
    decode_speaker,
    decode_spk_stat,
    encode_audio_prompt,
    encode_speaker,
    encode_spk_stat,
    normalize_speaker,
    sample_random_speaker,
)

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


@pytest.fixture(scope="module")
def spk_json() -> dict:
    return json.loads((GOLDEN / "b_speaker.json").read_text())


@pytest.fixture(scope="module")
def spk_npz():
    return np.load(GOLDEN / "b_speaker.npz")


def _bits(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, dtype=np.float16).view(np.uint16)


# ---- base16384 --------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.binary(max_size=64))
def test_base16384_roundtrip(data):
    s = base16384.encode(data)
    assert base16384.decode(s) == data
    assert len(s) == 4 * (len(data) // 7) + ((-(-8 * (len(data) % 7) // 14) + 1) if len(data) % 7 else 0)


def test_base16384_known_layout():
    # 7 bytes = 56 bits = four 14-bit characters, most significant first, from U+4E00.
    assert base16384.encode(bytes(7)) == "\u4e00" * 4
    assert base16384.encode(b"\xff" * 7) == chr(0x4E00 + 0x3FFF) * 4
    # 1 trailing byte 0x80: one character (0x80 << 6 = 0x2000) and the terminator U+3D01.
    assert base16384.encode(b"\x80") == chr(0x4E00 + 0x2000) + "\u3d01"


@pytest.mark.parametrize("bad", ["abc", "\u4e00\u4e00\u3d01", "\u4e00\u4e00\u4e00", "\u4e00\u3d07"])
def test_base16384_rejects_malformed(bad):
    with pytest.raises(ValueError, match="base16384"):
        base16384.decode(bad)


# ---- speaker embeddings ----------------------------------------------------------------------------


@pytest.mark.parametrize("size", ["tiny", "full"])
def test_decode_speaker_matches_golden(spk_json, spk_npz, size):
    s = spk_json[size]["spk_emb"]
    vec = decode_speaker(s, dim=int(spk_json[size]["dim"]))
    assert vec.dtype == np.float16
    np.testing.assert_array_equal(_bits(vec), _bits(spk_npz[f"{size}_spk_emb_fp16"]))
    assert encode_speaker(vec) == s  # LZMA2 preset 9|extreme reproduces the reference bytes
    np.testing.assert_array_equal(_bits(normalize_speaker(vec)), _bits(spk_npz[f"{size}_spk_emb_normalized_fp16"]))


def test_full_sampled_equals_decoded(spk_npz):
    np.testing.assert_array_equal(_bits(spk_npz["full_spk_emb_sampled_fp16"]), _bits(spk_npz["full_spk_emb_fp16"]))


def test_spk_stat_and_random_speaker_match_golden(spk_json, spk_npz):
    cfg = json.loads((GOLDEN / "assets-tiny" / "chattts_config.json").read_text())
    std, mean = decode_spk_stat(cfg["spk_stat"])
    np.testing.assert_array_equal(_bits(std), _bits(spk_npz["tiny_spk_stat_std_fp16"]))
    np.testing.assert_array_equal(_bits(mean), _bits(spk_npz["tiny_spk_stat_mean_fp16"]))
    assert encode_spk_stat(std, mean) == cfg["spk_stat"]
    spk = sample_random_speaker(std, mean, seed=int(spk_json["tiny"]["torch_manual_seed"]))
    np.testing.assert_array_equal(_bits(spk), _bits(spk_npz["tiny_spk_emb_fp16"]))
    assert encode_speaker(spk) == spk_json["tiny"]["spk_emb"]


# `torch.manual_seed(seed); torch.randn(dim, dtype=torch.float16)` on CPU, recorded with torch 2.9.1
# (the reference's version); newer torch gives other values, which is why the sampler replays 2.9.
TORCH29_RANDN_FP16_BITS = {
    (1, 16): [48162, 47039, 16469, 15506, 16390, 13171, 47343, 9661, 14592, 11818, 15386, 14243, 46370, 48184,
              14729, 16217],
    (2**40 + 3, 20): [49299, 47743, 14970, 48789, 48254, 47511, 15462, 14631, 48003, 47420, 14506, 48554, 16519,
                      14174, 15476, 45108, 48501, 15939, 45182, 14929],
    (7, 33): [45696, 48266, 46148, 43722, 13858, 13136, 14224, 45915, 46574, 47562, 47580, 14844, 48849, 13953,
              15327, 16159, 47940, 48754, 15809, 15727, 14854, 13734, 45433, 45246, 47496, 48183, 46233, 16051,
              15430, 13312, 48234, 15630, 14691],
}  # fmt: skip


@pytest.mark.parametrize("seed,dim", sorted(TORCH29_RANDN_FP16_BITS))
def test_sampler_replays_torch29_randn(seed, dim):
    ones, zeros = np.ones(dim, np.float16), np.zeros(dim, np.float16)
    got = sample_random_speaker(ones, zeros, seed)
    assert got.view(np.uint16).tolist() == TORCH29_RANDN_FP16_BITS[(seed, dim)]


def test_sampler_is_deterministic_and_seed_dependent():
    std, mean = np.full(768, 2.0, np.float16), np.full(768, 0.5, np.float16)
    a, b = sample_random_speaker(std, mean, 42), sample_random_speaker(std, mean, 42)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, sample_random_speaker(std, mean, 43))
    z = (a.astype(np.float64) - 0.5) / 2.0
    assert abs(z.mean()) < 0.15 and 0.85 < z.std() < 1.15  # standard normal draws
    with pytest.raises(ValueError, match="dim must be >= 16"):
        sample_random_speaker(std[:8], mean[:8], 0)
    with pytest.raises(ValueError, match="equal length"):
        sample_random_speaker(std, mean[:10], 0)


@pytest.mark.parametrize("bad", ["", "not base16384", base16384.encode(b"plain bytes, not lzma")])
def test_decode_speaker_rejects_malformed(bad):
    with pytest.raises(ValueError, match="spk_emb"):
        decode_speaker(bad)


def test_decode_speaker_checks_dim_and_finiteness(spk_json):
    with pytest.raises(ValueError, match="needs 768"):
        decode_speaker(spk_json["tiny"]["spk_emb"], dim=768)
    with pytest.raises(ValueError, match="non-finite"):
        decode_speaker(encode_speaker(np.array([1.0, np.inf], dtype=np.float16)))
    with pytest.raises(ValueError, match="1-D"):
        encode_speaker(np.zeros((2, 2), np.float16))


# ---- audio prompts (spk_smp) ----------------------------------------------------------------------


def test_audio_prompt_matches_dvae_golden():
    e = json.loads((GOLDEN / "e_spk_encode.json").read_text())
    codes = np.load(GOLDEN / "e_spk_encode.npz")["codes"]
    got = decode_audio_prompt(e["spk_smp"], num_codes=625)
    assert got.dtype == np.int32 and got.shape == (4, 32)
    np.testing.assert_array_equal(got, codes)
    assert encode_audio_prompt(codes) == e["spk_smp"]


def test_audio_prompt_matches_e2e_golden():
    f = json.loads((GOLDEN / "f_e2e.json").read_text())["e2e_zh_split"]
    codes = np.array(f["spk_smp_codes"], dtype=np.int32)
    assert codes.shape == (4, 40)
    np.testing.assert_array_equal(decode_audio_prompt(f["spk_smp"]), codes)
    assert encode_audio_prompt(codes) == f["spk_smp"]
    assert f["code_calls"][1]["spk_smp"] == f["spk_smp"]


@settings(max_examples=8, deadline=None, derandomize=True)  # LZMA preset 9|extreme costs ~0.1 s per encode
@given(st.integers(1, 50), st.integers(0, 2**31 - 1))
def test_audio_prompt_roundtrip(t, seed):
    codes = np.random.default_rng(seed).integers(0, 625, (4, t)).astype(np.int32)
    np.testing.assert_array_equal(decode_audio_prompt(encode_audio_prompt(codes)), codes)


def test_audio_prompt_rejects_malformed():
    good = encode_audio_prompt(np.arange(8, dtype=np.int32).reshape(4, 2))
    with pytest.raises(ValueError, match="expected \\(4, T > 0\\)"):
        decode_audio_prompt(encode_audio_prompt(np.zeros((3, 2), np.int32)))
    with pytest.raises(ValueError, match="out of range"):
        decode_audio_prompt(encode_audio_prompt(np.full((4, 2), 625, np.int32)), num_codes=625)
    raw = base16384.decode(good)
    with pytest.raises(ValueError, match="spk_smp: .*LZMA2"):
        decode_audio_prompt(base16384.encode(raw[:4] + b"\x01\x02\x03"))
    wrong_shape = np.array([4, 5], dtype="<u2").tobytes() + raw[4:]  # header says T=5, payload holds T=2
    with pytest.raises(ValueError, match="needs 40"):
        decode_audio_prompt(base16384.encode(wrong_shape))
    with pytest.raises(ValueError, match="spk_smp"):
        decode_audio_prompt("")
    with pytest.raises(ValueError, match="uint16"):
        encode_audio_prompt(np.full((4, 2), -1))
    blob = base16384.decode(encode_speaker(np.ones(64, np.float16)))
    with pytest.raises(ValueError, match="truncated"):
        decode_speaker(base16384.encode(blob[:-3]))

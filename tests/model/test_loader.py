"""Checkpoint loading in the published layout: round trip, hub snapshot layout, digests and every loader error."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ttsserve.config import EngineConfig
from ttsserve.model.chattts import build_model, load_model
from ttsserve.model.dummy import make_dummy_checkpoint, save_checkpoint
from ttsserve.model.loader import (
    asset_files,
    file_sha256,
    load_checkpoint,
    resolve_checkpoint_root,
    sha256_key,
    verify_digests,
)

GOLDEN_TINY = Path(__file__).resolve().parents[1] / "golden" / "assets-tiny"


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ckpt")
    save_checkpoint(make_dummy_checkpoint("tiny", seed=3), root)
    return root


def test_published_layout_written(written):
    for rel in asset_files():
        assert (written / rel).is_file(), rel
    cfg = json.loads((written / "asset/gpt/config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["num_vq"] == 4


def test_every_tensor_lands_where_it_belongs(written):
    """Load through the real path and compare every module parameter with the file's tensor."""
    ckpt = make_dummy_checkpoint("tiny", seed=3)
    model = build_model(load_checkpoint(written), torch.device("cpu"), torch.float32)
    gpt = load_file(str(written / "asset/gpt/model.safetensors"))
    for i, layer in enumerate(model.gpt.layers):
        p = f"layers.{i}."
        qkv = torch.cat([gpt[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        assert torch.equal(layer.qkv_proj.weight, qkv)
        assert torch.equal(layer.o_proj.weight, gpt[p + "self_attn.o_proj.weight"])
        gate_up = torch.cat([gpt[p + "mlp.gate_proj.weight"], gpt[p + "mlp.up_proj.weight"]])
        assert torch.equal(layer.gate_up_proj.weight, gate_up)
        assert torch.equal(layer.down_proj.weight, gpt[p + "mlp.down_proj.weight"])
        assert torch.equal(layer.input_layernorm.weight, gpt[p + "input_layernorm.weight"])
    assert torch.equal(model.gpt.norm.weight, gpt["norm.weight"])
    emb = ckpt.embed
    assert torch.equal(model.embed.emb_text, emb["emb_text.weight"])
    assert torch.equal(model.embed.emb_code[2], emb["emb_code.2.weight"])
    g, v = emb["head_code.1.parametrizations.weight.original0"], emb["head_code.1.parametrizations.weight.original1"]
    folded = g * v / v.norm(dim=1, keepdim=True)
    v_audio = emb["emb_code.0.weight"].shape[0]
    torch.testing.assert_close(model.embed.head_code[v_audio : 2 * v_audio], folded, atol=1e-6, rtol=1e-6)
    sd = {k: v for k, v in model.vocos.state_dict().items()}
    assert any(torch.equal(t, ckpt.vocos["head.out.weight"]) for t in sd.values())
    assert model.tokenizer.vocab_size == model.embed.num_text_tokens
    assert model.spk_stat is not None and model.spk_stat[0].shape == (64,)


def test_root_resolution(written, tmp_path):
    assert resolve_checkpoint_root(written) == written
    assert resolve_checkpoint_root(written / "asset") == written
    # A HuggingFace hub snapshot is a plain folder holding asset/ too (2Noise/ChatTTS layout).
    snap = tmp_path / "models--2Noise--ChatTTS" / "snapshots" / "abc123"
    shutil.copytree(written, snap)
    assert resolve_checkpoint_root(snap) == snap
    with pytest.raises(ValueError, match="not a ChatTTS checkpoint"):
        resolve_checkpoint_root(tmp_path)
    with pytest.raises(ValueError, match="no such checkpoint folder"):
        resolve_checkpoint_root(tmp_path / "nope")


def test_golden_digests_verify():
    verify_digests(GOLDEN_TINY)  # the golden checkpoint carries a sha256_map.json
    assert sha256_key("asset/gpt/model.safetensors") == "sha256_asset_gpt_model_safetensors"


def _copy(written: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "c"
    shutil.copytree(written, dst)
    return dst


def test_missing_file_is_named(written, tmp_path):
    root = _copy(written, tmp_path)
    (root / "asset/Vocos.safetensors").unlink()
    with pytest.raises(ValueError, match="missing file.*asset/Vocos.safetensors"):
        load_checkpoint(root)


def test_wrong_digest_is_named(written, tmp_path):
    root = _copy(written, tmp_path)
    digests = {sha256_key(r): file_sha256(root / r) for r in asset_files()}
    (root / "sha256_map.json").write_text(json.dumps(digests))
    verify_digests(root)
    sd = load_file(str(root / "asset/Decoder.safetensors"))
    sd["coef"] = sd["coef"] + 1
    save_file(sd, str(root / "asset/Decoder.safetensors"))
    with pytest.raises(ValueError, match="Decoder.safetensors: SHA-256 .* does not match"):
        load_checkpoint(root, verify_sha256=True)


def test_published_digests_reject_random_weights(written):
    with pytest.raises(ValueError, match="does not match the published digest"):
        verify_digests(written)  # no sha256_map.json: the real release's digests apply


@pytest.mark.parametrize(
    "fname,key,change",
    [
        ("asset/gpt/model.safetensors", "layers.1.mlp.up_proj.weight", "drop"),
        ("asset/gpt/model.safetensors", "layers.0.self_attn.q_proj.weight", "shape"),
        ("asset/Embed.safetensors", "head_code.3.parametrizations.weight.original1", "drop"),
        ("asset/Decoder.safetensors", "decoder.decoder_block.1.pwconv1.weight", "shape"),
        ("asset/DVAE.safetensors", "vq_layer.quantizer.rvqs.1.project_out.bias", "drop"),
        ("asset/Vocos.safetensors", "head.out.weight", "shape"),
    ],
)
def test_bad_tensor_is_named(written, tmp_path, fname, key, change):
    root = _copy(written, tmp_path)
    sd = load_file(str(root / fname))
    if change == "drop":
        del sd[key]
    else:
        sd[key] = torch.zeros(*(s + 1 for s in sd[key].shape))
    save_file(sd, str(root / fname))
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        build_model(load_checkpoint(root), torch.device("cpu"), torch.float32)


def test_unreadable_safetensors(written, tmp_path):
    root = _copy(written, tmp_path)
    (root / "asset/Embed.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="Embed.safetensors: not a readable safetensors file"):
        load_checkpoint(root)


def test_dummy_fallback_warns_loudly(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TTSSERVE_MODEL", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with caplog.at_level("WARNING"):
        model = load_model(EngineConfig(dummy_size="tiny", dtype="float32", device="cpu"))
    assert model.is_dummy
    assert "RANDOM weights" in caplog.text and "falling back to --load-format dummy" in caplog.text
    with pytest.raises(ValueError, match="no ChatTTS checkpoint found"):
        load_model(EngineConfig(load_format="safetensors", device="cpu"))

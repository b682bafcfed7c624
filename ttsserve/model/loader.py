"""Reading a ChatTTS checkpoint exactly as published (MODEL.md §1.1-1.2).

Layout (relative to the root): `asset/gpt/{config.json, model.safetensors}`,
`asset/{Embed, Decoder, DVAE, Vocos}.safetensors`, `asset/tokenizer/{tokenizer.json, tokenizer_config.json,
special_tokens_map.json}`. The root may be a plain folder, the `asset/` folder itself, a HuggingFace hub snapshot
of `2Noise/ChatTTS` (found through `huggingface_hub` in the local cache, or online), or a hub repo id.
Optional extras next to `asset/`: `chattts_config.json` (sizes and `spk_stat`), `sha256_map.json`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

HF_REPO_ID = "2Noise/ChatTTS"
COMPONENTS = ("Embed", "Decoder", "DVAE", "Vocos")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

# The published digests, as far as MODEL.md §1.2 records them (first 8 and last 4 hex digits of each SHA-256).
# A checkpoint that ships a `sha256_map.json` (the reference's own format) is checked against full digests.
PUBLISHED_SHA256 = {
    "sha256_asset_Decoder_safetensors": ("77aa55e0", "d4e0"),
    "sha256_asset_DVAE_safetensors": ("1d0b044a", "74d9"),
    "sha256_asset_Embed_safetensors": ("2ff0be71", "48b0"),
    "sha256_asset_Vocos_safetensors": ("07e55614", "3f44"),
    "sha256_asset_gpt_config_json": ("0aaa1ecd", "c236"),
    "sha256_asset_gpt_model_safetensors": ("cd0806fd", "4a0f"),
    "sha256_asset_tokenizer_special_tokens_map_json": ("bd0ac9d9", "d011"),
    "sha256_asset_tokenizer_tokenizer_config_json": ("43e9d658", "d421"),
    "sha256_asset_tokenizer_tokenizer_json": ("843838a6", "c20e"),
}


@dataclass
class Checkpoint:
    """Every tensor and file of one ChatTTS checkpoint, not yet built into modules.

    State dicts hold the file's tensors as stored (fp32 on the published checkpoint).
    """

    gpt_config: dict
    gpt: dict[str, torch.Tensor]
    embed: dict[str, torch.Tensor]
    decoder: dict[str, torch.Tensor]
    dvae: dict[str, torch.Tensor]
    vocos: dict[str, torch.Tensor]
    tokenizer_dir: Path
    extra_config: dict = field(default_factory=dict)  # chattts_config.json, when present
    source: str = ""  # a human-readable origin ("/path/asset", "dummy real seed 0")

    def state_dicts(self) -> dict[str, dict[str, torch.Tensor]]:
        return {
            "gpt/model": self.gpt,
            "Embed": self.embed,
            "Decoder": self.decoder,
            "DVAE": self.dvae,
            "Vocos": self.vocos,
        }


def sha256_key(rel_path: str) -> str:
    """The reference's digest key: `asset/gpt/model.safetensors` -> `sha256_asset_gpt_model_safetensors`."""
    *dirs, name = rel_path.split("/")
    return "sha256_" + "_".join(dirs) + "_" + name.replace(".", "_")


def asset_files() -> list[str]:
    files = ["asset/gpt/config.json", "asset/gpt/model.safetensors"]
    files += [f"asset/{c}.safetensors" for c in COMPONENTS]
    files += [f"asset/tokenizer/{f}" for f in TOKENIZER_FILES]
    return files


def missing_files(root: str | os.PathLike) -> list[str]:
    """The published files (asset_files()) absent under `root`, the folder holding asset/."""
    return [f for f in asset_files() if not (Path(root) / f).is_file()]


def resolve_checkpoint_root(model: str | os.PathLike | None) -> Path | None:
    """Find the folder that holds `asset/`; None when no checkpoint can be found.

    `model` may be a folder (holding `asset/`, or being `asset/`), a hub snapshot folder, or the hub id
    `2Noise/ChatTTS`. With `model=None`: `$TTSSERVE_MODEL`, then `./asset`, then the local hub cache.
    """
    if model is None:
        env = os.environ.get("TTSSERVE_MODEL")
        if env:
            return resolve_checkpoint_root(env)
        if (Path.cwd() / "asset" / "gpt" / "config.json").is_file():
            return Path.cwd()
        return _hub_snapshot(HF_REPO_ID, local_only=True)
    path = Path(model).expanduser()
    if path.exists():
        if (path / "asset").is_dir():
            return path
        if path.name == "asset" and (path / "gpt").is_dir():
            return path.parent
        raise ValueError(
            f"{path}: not a ChatTTS checkpoint (expected an 'asset/' folder with gpt/, tokenizer/ "
            f"and the Embed/Decoder/DVAE/Vocos safetensors)"
        )
    if "/" in str(model) and not str(model).startswith((".", "/")):
        root = _hub_snapshot(str(model), local_only=os.environ.get("HF_HUB_OFFLINE") == "1")
        if root is None:
            raise ValueError(f"{model}: not found in the local HuggingFace cache and could not be downloaded")
        return root
    raise ValueError(f"{model}: no such checkpoint folder")


def _hub_snapshot(repo_id: str, local_only: bool) -> Path | None:
    """A `2Noise/ChatTTS`-layout snapshot from the hub cache (or downloaded when online and allowed)."""
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors"], local_files_only=local_only)
    except Exception as e:  # offline, not cached, hub unreachable: all mean "no snapshot here"
        logger.debug("no hub snapshot of %s: %s", repo_id, e)
        return None
    root = Path(path)
    return root if (root / "asset").is_dir() else None


def load_checkpoint(root: str | os.PathLike, verify_sha256: bool = False) -> Checkpoint:
    """Read every file of the checkpoint at `root` (the folder holding `asset/`).

    Raises ValueError naming the file for a missing file, an unreadable safetensors file or a wrong digest.
    """
    from safetensors.torch import load_file

    root = Path(root)
    missing = missing_files(root)
    if missing:
        raise ValueError(f"checkpoint {root}: missing file(s): {', '.join(missing)}")
    if verify_sha256:
        verify_digests(root)

    def read(rel: str) -> dict[str, torch.Tensor]:
        try:
            return load_file(str(root / rel))  # memory-mapped read
        except Exception as e:
            raise ValueError(f"{root / rel}: not a readable safetensors file ({e})") from None

    gpt_config = json.loads((root / "asset/gpt/config.json").read_text())
    extra_path = root / "chattts_config.json"
    extra = json.loads(extra_path.read_text()) if extra_path.is_file() else {}
    return Checkpoint(
        gpt_config=gpt_config,
        gpt=read("asset/gpt/model.safetensors"),
        embed=read("asset/Embed.safetensors"),
        decoder=read("asset/Decoder.safetensors"),
        dvae=read("asset/DVAE.safetensors"),
        vocos=read("asset/Vocos.safetensors"),
        tokenizer_dir=root / "asset/tokenizer",
        extra_config=extra,
        source=str(root / "asset"),
    )


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verify_digests(root: Path) -> None:
    """Check the 9 asset files against `root/sha256_map.json` if present, else the published digests."""
    map_path = root / "sha256_map.json"
    full = json.loads(map_path.read_text()) if map_path.is_file() else None
    for rel in asset_files():
        key = sha256_key(rel)
        digest = file_sha256(root / rel)
        if full is not None:
            if key not in full:
                raise ValueError(f"{map_path}: no digest for {rel} (key {key})")
            ok = digest == full[key]
            want = full[key]
        else:
            head, tail = PUBLISHED_SHA256[key]
            ok = digest.startswith(head) and digest.endswith(tail)
            want = f"{head}…{tail}"
        if not ok:
            raise ValueError(f"{root / rel}: SHA-256 {digest} does not match the published digest {want}")

"""A tiny random checkpoint on disk whose code stage samples EOS at its first step, every time: a real engine
that produces no audio (the dummy's EOS clock, model/dummy_eos.py, replaced by a bias that beats every code)."""

from __future__ import annotations

from pathlib import Path

from ttsserve.model.dummy import make_dummy_checkpoint, save_checkpoint
from ttsserve.model.dummy_eos import BIAS, EOS_ID


def eos_at_once_checkpoint(root: Path) -> Path:
    """Write it under `root` (returns root, the folder holding asset/)."""
    ckpt = make_dummy_checkpoint("tiny", 0, tokenizer_dir=root / "asset" / "tokenizer")
    v = ckpt.embed["head_code.0.parametrizations.weight.original1"]
    v[EOS_ID] = 0.0
    v[EOS_ID, BIAS] = 1.0  # the constant channel alone (about 1.7 at the prompt's last position): no clock
    ckpt.embed["head_code.0.parametrizations.weight.original0"][EOS_ID] = 1e4  # thousands above every code
    return save_checkpoint(ckpt, root)

"""cached_dummy_checkpoint: random weights written once in the published layout, then memory-mapped.

A real-size dummy checkpoint is ~250 M random numbers (seconds to draw); saved once under $TTSSERVE_CACHE
(default ~/.cache/ttsserve) and read back with safetensors, later starts skip the drawing.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from ttsserve.model.dummy import make_dummy_checkpoint, recipe_id, save_checkpoint


def cached_dummy_checkpoint(size: str, seed: int = 0, cache_dir: str | os.PathLike | None = None) -> Path:
    """A random checkpoint of `size` saved once in the published layout; returns the folder holding asset/.
    Written to a temporary name and renamed, so concurrent first starts never see half a checkpoint."""
    root = Path(cache_dir or os.environ.get("TTSSERVE_CACHE") or Path.home() / ".cache" / "ttsserve")
    path = root / f"dummy-{size}-seed{seed}-{recipe_id(size)}"  # a new recipe never reads an old cache
    if (path / "asset" / "gpt" / "model.safetensors").is_file():
        return path
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=root))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache may serve other users' servers
    save_checkpoint(make_dummy_checkpoint(size, seed, tokenizer_dir=tmp / "asset" / "tokenizer"), tmp)
    try:
        tmp.rename(path)
    except OSError:  # another process won the race: use its copy
        shutil.rmtree(tmp, ignore_errors=True)
    return path

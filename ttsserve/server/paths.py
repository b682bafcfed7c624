"""The files a server writes outside its run directory, logged once at start so an operator knows what a
default start leaves on the machine (docs/DEPLOY.md, "Files outside the run")."""

from __future__ import annotations

import getpass
import logging
import os
import tempfile

from ttsserve.server.db_url import is_postgres_url

logger = logging.getLogger("ttsserve.server")


def outside_paths(engine_cfg, server_cfg) -> dict[str, str]:
    """What -> path, for the files this configuration writes outside the run directory."""
    paths: dict[str, str] = {}
    if server_cfg.voices_db != ":memory:" and not is_postgres_url(server_cfg.voices_db):
        paths["voices (--voices-db, TTSSERVE_VOICES_DB)"] = os.path.abspath(server_cfg.voices_db)
    if engine_cfg.load_format == "dummy":
        cache = os.environ.get("TTSSERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ttsserve")
        paths["dummy checkpoints (TTSSERVE_CACHE)"] = cache
    inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(
        tempfile.gettempdir(), "torchinductor_" + _user()
    )
    paths["torch.compile cache (TORCHINDUCTOR_CACHE_DIR)"] = inductor
    if engine_cfg.device != "cpu":
        triton = os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")
        paths["Triton kernels on CUDA (TRITON_CACHE_DIR)"] = triton
    return paths


def log_outside_paths(engine_cfg, server_cfg) -> None:
    for what, path in outside_paths(engine_cfg, server_cfg).items():
        logger.info("writes %s: %s", what, path)
    warn_about_shared_voices_db(server_cfg.voices_db)


def warn_about_shared_voices_db(voices_db: str) -> None:
    """Voices were once kept in one voices.db for every server; the default is now a file per port. A user who
    saved voices there is told how to keep using them (at start, after the configuration was accepted)."""
    if voices_db == ":memory:" or is_postgres_url(voices_db) or os.path.basename(voices_db) == "voices.db":
        return
    legacy = os.path.join(os.path.dirname(voices_db), "voices.db")
    if os.path.exists(legacy) and not os.path.exists(voices_db):
        logger.warning(
            "voices are now kept per port in %s; the voices saved before are in %s: pass --voices-db %s to keep "
            "using them",
            voices_db,
            legacy,
            legacy,
        )


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container's arbitrary user)
        return str(os.getuid())

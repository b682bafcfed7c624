"""The files a server writes outside its run directory are named at start, and a user whose voices sit in the
old shared voices.db is told how to keep them (after the configuration was accepted, not before its errors)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from ttsserve.server.paths import log_outside_paths, outside_paths, warn_about_shared_voices_db


def test_outside_paths_name_each_file_with_its_flag(tmp_path, monkeypatch):
    monkeypatch.setenv("TTSSERVE_CACHE", str(tmp_path / "cache"))
    engine_cfg = SimpleNamespace(load_format="dummy", device="cpu")
    paths = outside_paths(engine_cfg, SimpleNamespace(voices_db=str(tmp_path / "voices-8000.db")))
    assert paths["voices (--voices-db, TTSSERVE_VOICES_DB)"] == str(tmp_path / "voices-8000.db")
    assert paths["dummy checkpoints (TTSSERVE_CACHE)"] == str(tmp_path / "cache")
    assert not any("Triton" in what for what in paths)  # CPU: no Triton cache
    assert "voices (--voices-db, TTSSERVE_VOICES_DB)" not in outside_paths(
        engine_cfg, SimpleNamespace(voices_db=":memory:")
    )


def test_the_old_shared_voices_file_is_pointed_out(tmp_path, caplog):
    per_port = tmp_path / "voices-8000.db"
    with caplog.at_level(logging.WARNING, logger="ttsserve.server"):
        warn_about_shared_voices_db(str(per_port))
    assert not caplog.records  # nothing saved before: nothing to say
    (tmp_path / "voices.db").write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="ttsserve.server"):
        warn_about_shared_voices_db(str(per_port))
        warn_about_shared_voices_db(str(tmp_path / "voices.db"))  # the user already points at it
    assert len(caplog.records) == 1 and f"--voices-db {tmp_path / 'voices.db'}" in caplog.text
    caplog.clear()
    per_port.write_bytes(b"")  # the per-port file exists: the user has moved on
    with caplog.at_level(logging.INFO, logger="ttsserve.server"):
        log_outside_paths(SimpleNamespace(load_format="dummy", device="cpu"), SimpleNamespace(voices_db=str(per_port)))
    assert "writes voices" in caplog.text and "voices are now kept per port" not in caplog.text

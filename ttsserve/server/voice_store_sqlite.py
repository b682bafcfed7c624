"""The voice table in a SQLite file (the embedded default), or in memory with ":memory:"."""

from __future__ import annotations

import os
import sqlite3
import threading

from ttsserve.server.voices import VoiceStore

_SCHEMA = """
CREATE TABLE IF NOT EXISTS voices (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    type TEXT NOT NULL,          -- seed | speaker | audio_sample
    created_at INTEGER NOT NULL,
    seed INTEGER,
    spk_emb BLOB,                -- fp16 little-endian [hidden]
    spk_smp BLOB,                -- int32 little-endian [num_vq, P], row-major
    spk_smp_rows INTEGER,
    txt_smp TEXT,
    owner TEXT DEFAULT NULL      -- the creating API key's id (a hash, never the key); NULL: visible to all
)
"""


class SqliteVoiceStore(VoiceStore):
    """One connection behind a lock (every statement is short). Servers of one machine may share the file.

    path: a file path (its folder is created), or ":memory:" for a store that does not persist.
    """

    order_by = "rowid"

    def __init__(self, path: str) -> None:
        self.path = path
        if path != ":memory:":
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL" if path != ":memory:" else "PRAGMA journal_mode=MEMORY")
        self._db.execute(_SCHEMA)
        self._migrate()

    def _migrate(self) -> None:
        """Databases from before voices had owners get the column (NULL: their voices stay visible to all).
        API servers sharing the file may race here: the loser's ALTER fails with a duplicate column."""
        cols = {row[1] for row in self._db.execute("PRAGMA table_info(voices)")}
        if "owner" not in cols:
            try:
                self._db.execute("ALTER TABLE voices ADD COLUMN owner TEXT DEFAULT NULL")
            except sqlite3.OperationalError as e:
                if "duplicate column" not in str(e):
                    raise

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _fetch(self, sql: str, args: tuple) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def _execute(self, sql: str, args: tuple) -> int:
        with self._lock:
            return self._db.execute(sql, args).rowcount

    def _insert(self, sql: str, row: tuple) -> bool:
        with self._lock:
            try:
                self._db.execute(sql, row)
            except sqlite3.IntegrityError:
                return False
        return True

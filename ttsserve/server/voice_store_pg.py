"""The voice table in PostgreSQL: one table, `voices`, shared by every server given the same --voices-db URL.

psycopg 3 (`pip install 'psycopg[binary]'`, or the `postgres` extra) is imported only when a URL selects this
backend. The server calls the store from worker threads (asyncio.to_thread); each call takes an idle
connection, or opens one, and hands it back after. Connections are in autocommit: every statement is its own
transaction, and a create's uniqueness is the UNIQUE constraint's, never a check before the insert.

The URL is libpq's: user, password, host(s), port, database and parameters (sslmode, connect_timeout,
options=-csearch_path%3Dother_schema, ...). connect_timeout defaults to 10 s, and, unless the URL sets
`options`, statement_timeout to 10 s: a database that hangs fails the call (503) instead of holding a worker
thread for as long as it hangs.
"""

from __future__ import annotations

import threading

from ttsserve.server.db_url import mask_url, redact
from ttsserve.server.voices import VoiceStore, VoiceStoreError

# Column meanings as in voice_store_sqlite.py. seq: creation order (SQLite's rowid). seed is BIGINT: a voice's
# seed goes up to 2**32 - 1.
_SCHEMA = """
CREATE TABLE voices (
    seq BIGINT GENERATED ALWAYS AS IDENTITY,
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    type TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    seed BIGINT,
    spk_emb BYTEA,
    spk_smp BYTEA,
    spk_smp_rows INTEGER,
    txt_smp TEXT,
    owner TEXT DEFAULT NULL
)
"""
# Held (per transaction) while the table is checked and created: two servers starting at once on an empty
# database would otherwise both run CREATE TABLE, and IF NOT EXISTS does not stop the loser failing on the
# catalog's unique index.
_DDL_LOCK_KEY = int.from_bytes(b"ttsvoice", "big") >> 1
_CONNECT_DEFAULTS = {"connect_timeout": "10", "application_name": "ttsserve", "options": "-c statement_timeout=10s"}


def _psycopg(url: str):
    try:
        import psycopg
    except ImportError:
        raise VoiceStoreError(
            mask_url(url), "needs psycopg 3: pip install 'psycopg[binary]' (or the ttsserve[postgres] extra)"
        ) from None
    return psycopg


class PostgresVoiceStore(VoiceStore):
    """url: postgresql://user:password@host:port/database (or postgres://...). Opening connects once and
    creates the table if it is missing; VoiceStoreError (password masked) if that fails.

    keep_idle: connections kept open between calls (more are opened while more calls run at once)."""

    order_by = "seq"

    def __init__(self, url: str, *, keep_idle: int = 8) -> None:
        self._psycopg = _psycopg(url)
        self._url = url
        self.shown = mask_url(url)
        self._keep_idle = keep_idle
        self._idle: list = []
        self._lock = threading.Lock()
        self._closed = False
        try:
            given = self._psycopg.conninfo.conninfo_to_dict(url)
        except self._psycopg.Error as e:
            raise self._error(e) from None
        self._connect_args = {k: v for k, v in _CONNECT_DEFAULTS.items() if k not in given}
        self._run(_create_table)

    def close(self) -> None:
        with self._lock:
            self._closed, idle, self._idle = True, self._idle, []
        for conn in idle:
            conn.close()

    def _fetch(self, sql: str, args: tuple) -> list[tuple]:
        return self._run(lambda conn: conn.execute(_placeholders(sql), args).fetchall())

    def _execute(self, sql: str, args: tuple) -> int:
        return self._run(lambda conn: conn.execute(_placeholders(sql), args).rowcount)

    def _insert(self, sql: str, row: tuple) -> bool:
        try:
            self._run(lambda conn: conn.execute(_placeholders(sql), row))
        except self._psycopg.errors.UniqueViolation:
            return False
        return True

    # ---- connections ---------------------------------------------------------------------------------
    def _run(self, work, retry: bool = True):
        """work(connection) on an idle or new connection. A reused connection that turns out dead (the server
        restarted, or dropped it while idle) is replaced once; any other failure is a VoiceStoreError, except
        a unique violation, which the caller handles."""
        conn, reused = None, False
        try:
            conn, reused = self._take()
            result = work(conn)
        except self._psycopg.errors.UniqueViolation:
            self._give_back(conn)
            raise
        except self._psycopg.Error as e:
            if conn is not None:
                conn.close()
            if retry and reused and isinstance(e, self._psycopg.OperationalError):
                return self._run(work, retry=False)
            raise self._error(e) from None
        except BaseException:
            if conn is not None:
                conn.close()
            raise
        self._give_back(conn)
        return result

    def _take(self):
        """(connection, reused)."""
        with self._lock:
            if self._closed:
                raise VoiceStoreError(self.shown, "the store is closed")
            if self._idle:
                return self._idle.pop(), True
        return self._psycopg.connect(self._url, autocommit=True, **self._connect_args), False

    def _give_back(self, conn) -> None:
        with self._lock:
            if not self._closed and not conn.closed and len(self._idle) < self._keep_idle:
                self._idle.append(conn)
                return
        conn.close()

    def _error(self, e: Exception) -> VoiceStoreError:
        return VoiceStoreError(self.shown, redact(str(e), self._url) or type(e).__name__)


def _placeholders(sql: str) -> str:
    """The store's `?` placeholders as psycopg's `%s` (the shared SQL has no other `?` or `%`)."""
    return sql.replace("?", "%s")


def _create_table(conn) -> None:
    """Create `voices` unless it exists. Checked first: creating needs the CREATE right on the schema (not
    granted on `public` by default since PostgreSQL 15), using an existing table does not."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_DDL_LOCK_KEY,))
        if conn.execute("SELECT to_regclass('voices')").fetchone()[0] is None:
            conn.execute(_SCHEMA)

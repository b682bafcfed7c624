"""Which voice store a --voices-db value names: a postgresql:// or postgres:// URL selects PostgreSQL
(voice_store_pg.py), where every server given the same URL sees the same voices; anything else is a SQLite
file path or ":memory:" (voice_store_sqlite.py)."""

from __future__ import annotations

from ttsserve.server.db_url import is_postgres_url, mask_url, redact

__all__ = ["is_postgres_url", "mask_url", "open_voice_store", "redact"]


def open_voice_store(spec: str):
    """The VoiceStore `spec` names (a PostgreSQL URL, a SQLite path or ":memory:"), its table created if
    missing. VoiceStoreError when a PostgreSQL store cannot be used (psycopg missing, the server unreachable,
    the login refused, no right to create the table)."""
    if is_postgres_url(spec):
        from ttsserve.server.voice_store_pg import PostgresVoiceStore

        return PostgresVoiceStore(spec)
    from ttsserve.server.voice_store_sqlite import SqliteVoiceStore

    return SqliteVoiceStore(spec)

"""A --voices-db value: a PostgreSQL URL or a SQLite path, and how to show it without its password.

A postgresql:// or postgres:// URL (libpq's URI form, query parameters included) names PostgreSQL; anything
else is a SQLite file path, or ":memory:". A --voices-db value reaches logs and error messages only through
mask_url / redact: a URL may carry a password.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

POSTGRES_SCHEMES = ("postgresql://", "postgres://")
MASK = "***"
_PASSWORD_PARAM = re.compile(r"([?&]password=)([^&#]*)", re.IGNORECASE)


def is_postgres_url(spec: str) -> bool:
    return spec.lower().startswith(POSTGRES_SCHEMES)


def _userinfo_password(spec: str) -> tuple[int, int] | None:
    """(start, end) of the password in a URL's user info (user:password@host), None if it has none. The
    authority ends at the first '/', '?' or '#'; its user info at the last '@' (an unescaped '@' in a
    password stays masked whole)."""
    start = spec.index("://") + 3
    end = min((i for i in (spec.find(c, start) for c in "/?#") if i >= 0), default=len(spec))
    at = spec.rfind("@", start, end)
    colon = spec.find(":", start, at)
    return None if at < 0 or colon < 0 else (colon + 1, at)


def mask_url(spec: str) -> str:
    """`spec` with a PostgreSQL URL's password (user info or a password= parameter) as ***; a SQLite path
    unchanged."""
    if not is_postgres_url(spec):
        return spec
    span = _userinfo_password(spec)
    if span is not None:
        spec = spec[: span[0]] + MASK + spec[span[1] :]
    return _PASSWORD_PARAM.sub(lambda m: m.group(1) + MASK, spec)


def _passwords(spec: str) -> set[str]:
    """The password(s) in a PostgreSQL URL, as written and percent-decoded."""
    found = set()
    span = _userinfo_password(spec)
    if span is not None:
        found.add(spec[span[0] : span[1]])
    found.update(m.group(2) for m in _PASSWORD_PARAM.finditer(spec))
    return {p for raw in found for p in (raw, unquote(raw)) if p}


def redact(text: str, spec: str) -> str:
    """`text` (a driver's message about `spec`) on one line, with the URL's password masked wherever it
    appears: libpq does not echo passwords, but a message quoting part of a malformed URL could."""
    if is_postgres_url(spec):
        for password in sorted(_passwords(spec), key=len, reverse=True):
            text = text.replace(password, MASK)
    return " ".join(text.split())

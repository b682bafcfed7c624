"""Engine errors the HTTP edge maps to status codes (torch-free, so API-server processes can import them)."""

from __future__ import annotations


class EngineOverloadedError(RuntimeError):
    """The engine cannot take the request now (queue full, starting, shutting down, core gone); retry later."""

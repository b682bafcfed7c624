"""The engine's typed errors, the only ones an EngineClient raises at its boundary (torch-free, so API-server
processes import them). They cross the ZMQ wire with their kind and param (core/messages.ErrorInfo) and the
server maps them to HTTP with one isinstance table (server/errors.engine_error).

    InvalidRequestError   the request as given is refused (a ValueError; `param` names the field) -> 400
    EngineOverloadedError the engine cannot take the request now (queue full, starting, shutting down) -> 503
    EngineDeadError       the engine cannot serve now (gone, restarting, or stalled) -> 503 engine_dead
    CoreUnreachableError  an EngineDeadError for a request no engine core admitted (safe to send elsewhere)
"""

from __future__ import annotations

from ttsserve.params import InvalidRequestError

__all__ = ["CoreUnreachableError", "EngineDeadError", "EngineOverloadedError", "InvalidRequestError"]


class EngineOverloadedError(RuntimeError):
    """The engine cannot take the request now (queue full, starting, shutting down); retry later."""


class EngineDeadError(EngineOverloadedError):
    """The engine cannot serve now: an engine thread that died (for good), an engine-core process that died
    (until the launcher's new core is up), or a loop that is stalled. The requests it held are lost. An
    EngineOverloadedError, so callers that only retry elsewhere need not tell them apart."""


class CoreUnreachableError(EngineDeadError):
    """The engine core this request went to died, or was already gone, before admitting it: no engine holds
    any of its state, so a data-parallel client may send it to another core. (A request a core admitted and
    then lost fails with a plain EngineDeadError: it might be what killed the core.)"""

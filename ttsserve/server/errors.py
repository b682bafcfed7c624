"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with a real HTTP status.

Every failure the server reports goes through `ApiError` (raised anywhere in a handler) or one of the
handlers installed by `install_error_handlers` (FastAPI validation errors become 400 naming the field,
unknown routes 404, anything unexpected 500). A response never says 200 while carrying an error.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ttsserve.engine.errors import (
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
)

logger = logging.getLogger("ttsserve.server")

# status -> OpenAI error `type` (the API uses invalid_request_error for most 4xx).
_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
    504: "server_error",
}
# status -> the code of an ApiError raised without one: every error carries a machine-readable code.
_DEFAULT_CODES = {
    400: "invalid_value",
    401: "invalid_api_key",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "request_too_large",
    415: "unsupported_media_type",
    429: "rate_limit_exceeded",
    499: "client_closed_request",
    500: "internal_error",
    503: "server_overloaded",
    504: "request_timeout",
}


class ApiError(Exception):
    """An HTTP error in the OpenAI shape.

    status: the HTTP status. param: the request field at fault (None when not a field).
    code: a short machine-readable code (e.g. "voice_not_found"; default: one per status). headers: extra
    response headers (Retry-After for 429/503, WWW-Authenticate for 401).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code or _DEFAULT_CODES.get(status, "error")
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, request_id: str | None = None) -> JSONResponse:
        headers = dict(self.headers)
        if request_id:
            headers["X-Request-ID"] = request_id
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


# The engine's typed errors (engine/errors.py) -> (status, code, headers); the first isinstance match wins, so
# a subclass comes before its base. A plain ValueError from the engine side is an invalid request too.
_ENGINE_ERRORS: tuple[tuple[type[BaseException], int, str, dict[str, str]], ...] = (
    (EngineDeadError, 503, "engine_dead", {"Retry-After": "1"}),
    (EngineOverloadedError, 503, "server_overloaded", {"Retry-After": "1"}),
    (ValueError, 400, "invalid_value", {}),
)


def engine_error(e: BaseException, param: str | None = None) -> BaseException:
    """`e` as its ApiError when it is an engine error (else `e` unchanged). param: the HTTP field to name
    for an invalid request (the caller maps the engine's InvalidRequestError.param to its own field names)."""
    for cls, status, code, headers in _ENGINE_ERRORS:
        if isinstance(e, cls):
            return ApiError(status, str(e), param=param if status == 400 else None, code=code, headers=dict(headers))
    return e


def engine_param(e: BaseException) -> str | None:
    """The request field an engine error names (InvalidRequestError.param), None for the rest."""
    return e.param if isinstance(e, InvalidRequestError) else None


# What json.loads raises on a hostile body besides JSONDecodeError: RecursionError for nesting deeper than the
# interpreter's recursion limit ("[" * 100000), ValueError for an integer of more digits than
# sys.get_int_max_str_digits() ("1" * 100000), UnicodeDecodeError for bytes that are not UTF-8/16/32. All
# are the client's fault (400), never a 500: an unhandled error also drops the connection.
JSON_PARSE_ERRORS = (ValueError, RecursionError)


def invalid_json(cause: BaseException | None = None) -> ApiError:
    """The one 400 for a request body that is not JSON the server can read; `cause`: what json.loads raised."""
    if isinstance(cause, json.JSONDecodeError):
        why = f": {cause.msg} at character {cause.pos}"
    elif isinstance(cause, UnicodeDecodeError):
        why = ": not UTF-8 text"
    elif isinstance(cause, RecursionError):
        why = ": nested too deeply"
    elif isinstance(cause, ValueError):
        why = f": a number has more than {sys.get_int_max_str_digits()} digits"
    else:
        why = ""
    return bad_request(f"request body is not valid JSON{why}", code="invalid_json")


def parse_json_body(body: bytes) -> Any:
    """json.loads for request bodies: ApiError(400, invalid_json) for anything it cannot parse."""
    try:
        return json.loads(body)
    except JSON_PARSE_ERRORS as e:
        raise invalid_json(e) from None


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "bytes"}


def _field_name(loc: tuple) -> str | None:
    """('body', 'voice', 'VoiceRef', 'id') -> 'voice.id': the leading 'body' and union branch tags dropped."""
    if not loc or loc[0] not in ("body", "query", "path"):
        return None
    parts = [str(p) for p in loc[1:] if not isinstance(p, int)]
    # pydantic names union branches ("str", "VoiceRef", "function-after[...]"): not fields.
    parts = [p for p in parts if p.isidentifier() and p[0].islower() and p not in _TYPE_TAGS]
    return ".".join(parts) or None


def validation_error(exc: RequestValidationError) -> ApiError:
    """FastAPI's 422 -> one 400 naming the first bad field (the others are listed in the message).

    For a union field (voice: str | object) the "wrong type for this branch" errors are dropped when
    another branch has a more specific complaint.
    """
    errors = list(exc.errors())
    if not errors:
        return bad_request("invalid request body")
    if errors[0].get("type") == "json_invalid":  # FastAPI raises it `from` the JSONDecodeError
        return invalid_json(exc.__cause__)
    specific = [e for e in errors if not str(e.get("type", "")).endswith("_type")]
    errors = specific or errors
    first = errors[0]
    param = _field_name(tuple(first.get("loc", ())))
    msgs = []
    for err in errors[:5]:
        name = _field_name(tuple(err.get("loc", ()))) or "body"
        msgs.append(f"{name}: {err.get('msg', 'invalid value')}")
    code = {"missing": "missing_required_parameter", "extra_forbidden": "unknown_parameter"}.get(
        first.get("type"), "invalid_value"
    )
    return bad_request("; ".join(msgs), param=param, code=code)


def _allowed_methods(app: FastAPI, scope: dict) -> list[str]:
    from starlette.routing import Match

    methods: set[str] = set()
    for route in app.router.routes:
        if getattr(route, "methods", None) and route.matches(scope)[0] is not Match.NONE:
            methods |= set(route.methods)
    return sorted(methods)


def _request_id(request: Request) -> str | None:
    return getattr(request.state, "request_id", None)


def _answer(request: Request, err: ApiError) -> JSONResponse:
    """err's response; its code and message go to the request's access-log line (error, reason)."""
    log = getattr(request.state, "log", None)
    if isinstance(log, dict):
        log.setdefault("error", err.code)
        log.setdefault("reason", err.message)
    return err.response(_request_id(request))


def install_error_handlers(app: FastAPI) -> None:
    """Route every error path of `app` into the OpenAI error shape."""

    async def on_api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _answer(request, exc)

    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _answer(request, validation_error(exc))

    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and isinstance(exc.__cause__, JSON_PARSE_ERRORS):
            # FastAPI's body parsing turns every json.loads failure but JSONDecodeError into a bare 400
            # "There was an error parsing the body", raised from the original error.
            return _answer(request, invalid_json(exc.__cause__))
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status_code)
        msg = exc.detail if isinstance(exc.detail, str) else "error"
        headers = dict(exc.headers or {})
        if exc.status_code == 404:
            msg = f"no route {request.method} {request.url.path}"
        if exc.status_code == 405:
            # Starlette's Allow names only the first route matching the path; a path served by several
            # routes (GET and POST /v1/audio/voices) must list them all.
            headers["Allow"] = ", ".join(_allowed_methods(app, request.scope))
            msg = f"{request.method} is not allowed on {request.url.path}; allowed: {headers['Allow']}"
        return _answer(request, ApiError(exc.status_code, msg, code=code, headers=headers))

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        err = ApiError(500, "internal server error", code="internal_error")
        request.state.log["reason"] = f"{type(exc).__name__}: {exc}"
        return _answer(request, err)

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)

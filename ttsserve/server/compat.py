"""What other TTS clients expect beside the OpenAI API: Open WebUI's and Kokoro's model list, CORS for
browsers, and lenient request bodies (as vLLM: unknown fields are ignored, logged and reported).

- `GET /v1/audio/models` -> `{"models": [{"id": ...}]}` (Open WebUI reads `{base}/audio/models`; the voice
  list's `voices: [{"id", "name"}]` is in voice_routes.py).
- `add_cors(app, cfg)`: Starlette's CORSMiddleware with vLLM's flags, only when --allowed-origins is set.
- `ExtraFields`: a synthesis body's unknown top-level fields, and the fields it accepts but does not use
  (`lang_code`), go to `X-Ignored-Fields`; each name is logged once per server; with --strict-request-fields
  an unknown field is a 400 naming it.
"""

from __future__ import annotations

import logging
import threading
from urllib.parse import quote

from fastapi import Depends, FastAPI, Request
from pydantic import BaseModel
from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware

from ttsserve.server.args import ServerConfig
from ttsserve.server.db_url import mask_url
from ttsserve.server.errors import ApiError
from ttsserve.server.timestamps import timestamps_mode

logger = logging.getLogger("ttsserve.server")

IGNORED_HEADER = "X-Ignored-Fields"
# Response headers a browser page may read cross-origin (the rest of ours are CORS-safelisted or not useful).
EXPOSED_HEADERS = (
    "X-Request-ID",
    "X-Finish-Reason",
    "X-Audio-Duration",
    "X-Truncated-Segments",
    IGNORED_HEADER,
    "Retry-After",
)
# Fields the bodies accept for other clients' sake but that change nothing here: reported, never an error.
ACCEPTED_UNUSED = ("lang_code",)
# Bounds against hostile bodies: field names are client data (any characters, any number of them).
MAX_REPORTED = 32  # names in one X-Ignored-Fields header
MAX_LOGGED = 256  # distinct names logged per server


class AudioModel(BaseModel):
    id: str


class AudioModelList(BaseModel):
    models: list[AudioModel]


def register_compat_routes(app: FastAPI, st, identity, errors: dict) -> None:
    """GET /v1/audio/models. `st`: the app's ServerState."""

    @app.get("/v1/audio/models", response_model=AudioModelList, responses=errors, tags=["models"])
    async def list_audio_models(_: str = Depends(identity)):
        """The accepted `model` names in the shape Open WebUI and Kokoro clients read."""
        return {"models": [{"id": n} for n in st.model_names]}


def speech_mode(body) -> str:
    """The response mode of a speech body: "audio" (chunked), "sse" (events), "file" (Kokoro's `stream: false`)
    or "json" (`timestamps` without a stream_format: the audio and its segments). 400 for a contradiction:
    `stream: false` with SSE, or timestamps on a raw audio stream (server/timestamps.py)."""
    if body.stream is False and body.stream_format == "sse":
        raise ApiError(400, "stream: false asks for one file, stream_format: sse for events; drop one", param="stream")
    if body.timestamps is not None:
        return timestamps_mode(body)
    return "file" if body.stream is False else body.stream_format


class _LoggedCORS(CORSMiddleware):
    """Starlette's CORS middleware; a preflight it refuses (400) names why in the access log."""

    async def __call__(self, scope, receive, send) -> None:
        headers = Headers(scope=scope) if scope["type"] == "http" else None
        if (
            headers is None
            or scope["method"] != "OPTIONS"
            or "origin" not in headers
            or "access-control-request-method" not in headers
        ):
            return await super().__call__(scope, receive, send)
        response = self.preflight_response(request_headers=headers)
        log = scope.get("state", {}).get("log")
        if response.status_code >= 400 and isinstance(log, dict):
            log.update(error="cors_refused", reason=f"CORS preflight refused: {response.body.decode()}")
        await response(scope, receive, send)


def add_cors(app: FastAPI, cfg: ServerConfig) -> None:
    """CORS through Starlette's middleware when --allowed-origins names any; otherwise nothing (no CORS
    headers, and a preflight OPTIONS is a 405 like any unrouted method)."""
    if not cfg.allowed_origins:
        return
    app.add_middleware(
        _LoggedCORS,
        allow_origins=list(cfg.allowed_origins),
        allow_methods=list(cfg.allowed_methods),
        allow_headers=list(cfg.allowed_headers),
        allow_credentials=cfg.allow_credentials,
        expose_headers=list(EXPOSED_HEADERS),
    )


class ExtraFields:
    """Unknown and unused body fields of one server: ignored and reported, or refused (strict)."""

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    def check(self, request: Request, body: BaseModel) -> None:
        """400 unknown_parameter for an unknown field when strict; otherwise the ignored names go to the
        X-Ignored-Fields header and the access log, and each new name to the server log once."""
        unknown = sorted(body.model_extra or {})
        if unknown and self.strict:
            raise ApiError(
                400,
                f"{unknown[0]}: Extra inputs are not permitted (this server runs with --strict-request-fields)",
                param=unknown[0],
                code="unknown_parameter",
            )
        ignored = [quote(f, safe="") for f in unknown]  # a header value cannot carry CR, LF or non-latin-1
        ignored += [f for f in ACCEPTED_UNUSED if getattr(body, f, None) is not None]
        if not ignored:
            return
        request.state.ignored_fields = ignored[:MAX_REPORTED]
        request.state.log["ignored_fields"] = ignored[:MAX_REPORTED]
        with self._lock:
            new = [f for f in ignored if f not in self._logged][: max(0, MAX_LOGGED - len(self._logged))]
            self._logged.update(new)
        for name in new:
            logger.warning(
                "ignoring request field %r on %s (it has no effect here; logged once per field name; "
                "--strict-request-fields refuses unknown fields)",
                name,
                request.url.path,
            )


class IgnoredFieldsHeader:
    """Pure ASGI: adds X-Ignored-Fields to a response whose handler recorded ignored body fields."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_header(msg) -> None:
            if msg["type"] == "http.response.start":
                ignored = scope.get("state", {}).get("ignored_fields")
                if ignored:
                    value = ",".join(ignored).encode("ascii")
                    msg = {**msg, "headers": [*msg.get("headers", []), (IGNORED_HEADER.lower().encode(), value)]}
            await send(msg)

        await self.app(scope, receive, send_with_header)


def log_ready(app: FastAPI, cfg: ServerConfig) -> None:
    """At start-up: which voices file this server uses and, where the launcher told the app its address
    (app.state.public_url), where the playground and the API docs are."""
    logger.info("voices database: %s", mask_url(cfg.voices_db))
    url = getattr(app.state, "public_url", None)
    if url:
        logger.info("ready: playground %s/  API docs %s/docs", url, url)

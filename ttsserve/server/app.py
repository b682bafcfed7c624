"""The FastAPI app: OpenAI-compatible speech, the simple /synthesize API, voices, models and operations.

`create_app(engine, cfg)` serves any EngineClient (engine/protocol.py): the in-process AsyncEngine, an API
server's CoreClient, or a test fake. The app starts the engine in its lifespan and drains it on shutdown;
a dead engine turns /health into a 503. Engine errors become HTTP errors through server/errors.engine_error.
"""

from __future__ import annotations

import json
import logging
import math
import time
import uuid
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from fastapi.security import HTTPBearer

from ttsserve.audio.encode import FORMATS, content_type, validate_format
from ttsserve.constants import SAMPLE_RATE
from ttsserve.engine.errors import EngineOverloadedError
from ttsserve.engine.protocol import EngineClient
from ttsserve.server.access_log import RequestContextMiddleware, access_logger
from ttsserve.server.args import ServerConfig
from ttsserve.server.compat import (
    ExtraFields,
    IgnoredFieldsHeader,
    add_cors,
    log_ready,
    register_compat_routes,
    speech_mode,
)
from ttsserve.server.drain import DrainMiddleware, DrainState
from ttsserve.server.errors import (
    ApiError,
    bad_request,
    engine_error,
    engine_param,
    install_error_handlers,
)
from ttsserve.server.limits import (
    AdmissionGate,
    ApiKeyAuth,
    BodyLimitMiddleware,
    KeyRequiredMiddleware,
    RateLimiter,
)
from ttsserve.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from ttsserve.server.metrics import ServerMetrics
from ttsserve.server.playground import register_playground
from ttsserve.server.protocol import (
    ChatTTSOptions,
    ErrorResponse,
    ModelList,
    ModelObject,
    SpeechRequest,
    SynthesizeRequest,
    VoiceCreateJSON,
    build_synthesis_request,
)
from ttsserve.server.streaming import (
    AudioPipeline,
    ClientGone,
    EngineStreamResponse,
    RequestTimeout,
    SynthesisJob,
    audio_body,
    collect_audio,
    prime,
    sse_body,
    until_disconnect,
)
from ttsserve.server.timestamps import json_response
from ttsserve.server.voice_routes import register_voice_routes
from ttsserve.server.voices import UnknownVoiceError, VoiceResolver, VoiceScope, VoiceStore
from ttsserve.server.warm_start import warm_up_api_server
from ttsserve.text.split import LATIN_WEIGHT, MAX_UNITS_PER_SECOND, min_speech_seconds

logger = logging.getLogger("ttsserve.server")

OPENAI_MODEL_NAMES = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "repetition_penalty", "max_new_tokens", "min_new_tokens", "seed")
_ERRORS = {s: {"model": ErrorResponse} for s in (400, 401, 403, 404, 413, 429, 500, 503, 504)}
_AUDIO_TYPES = {content_type(f): {"schema": {"type": "string", "format": "binary"}} for f in FORMATS}
_AUDIO_200 = {"description": "the audio, in the requested format", "content": _AUDIO_TYPES}


class ServerState:
    """Everything the handlers share; one per app."""

    def __init__(self, engine: EngineClient, cfg: ServerConfig, rate_limiter=None) -> None:
        self.engine = engine
        self.cfg = cfg
        self.auth = ApiKeyAuth(cfg.api_keys, cfg.admin_api_keys)
        self.rate = rate_limiter or RateLimiter(cfg.requests_per_minute, cfg.chars_per_minute)
        self.gate = AdmissionGate(cfg.max_in_flight)
        self.metrics = ServerMetrics(engine.stats, (cfg.served_model_names or (engine.model_name,))[0])
        self.store = VoiceStore(cfg.voices_db)
        self.voices = VoiceResolver(self.store, engine.random_speaker, engine.parse_speaker)
        names = cfg.served_model_names or (engine.model_name, *OPENAI_MODEL_NAMES)
        self.model_names = tuple(dict.fromkeys(names))
        self.created = int(time.time())
        self.extra_fields = ExtraFields(cfg.strict_request_fields)

    # ---- admission -------------------------------------------------------------------------------
    def identity(self, request: Request) -> str:
        """API key check (401); returns the rate-limit identity (key id, else the client address) and sets
        request.state.voice_scope: a plain key sees its own voices and the public ones, and what it makes
        is its own; an admin key, or a server without keys, sees all and makes public voices."""
        key_id = self.auth.check(request.headers.get("authorization"))
        ident = key_id or f"ip-{request.client.host if request.client else 'unknown'}"
        request.state.log["key"] = ident
        private = key_id is not None and not self.auth.is_admin(key_id)
        request.state.voice_scope = VoiceScope(key_id, False) if private else VoiceScope()
        return ident

    def admit_text(self, text: str, ident: str, param: str) -> Callable[[], None]:
        """413 for text over the limit, 429 over the rate limits; returns the rate-limit refund."""
        if len(text) > self.cfg.max_input_chars:
            raise ApiError(
                413,
                f"{param} has {len(text)} characters; the limit is {self.cfg.max_input_chars}",
                param=param,
                code="input_too_long",
            )
        return self.rate.check(ident, len(text))

    def check_model(self, model: str) -> None:
        if model not in self.model_names:
            raise ApiError(
                404,
                f"model {model!r} not found; available: {', '.join(self.model_names)}",
                param="model",
                code="model_not_found",
            )

    def resolve_voice(self, spec, param: str = "voice", scope: VoiceScope = VoiceScope()):  # noqa: B008 - frozen
        try:
            voice = self.voices.resolve(spec, scope)
        except ValueError as e:
            raise bad_request(f"{param}: {e}", param=param) from None
        except UnknownVoiceError as e:
            raise ApiError(404, f"voice {e.name!r} not found", param=param, code="voice_not_found") from None
        if voice is None:
            raise ApiError(
                404,
                f"voice {spec if isinstance(spec, str) else spec.id!r} not found",
                param=param,
                code="voice_not_found",
            )
        return voice

    # ---- synthesis -------------------------------------------------------------------------------
    async def synthesize(
        self,
        request: Request,
        *,
        endpoint: str,
        text: str,
        text_param: str,
        voice,
        opts: ChatTTSOptions,
        speed: float,
        instructions: str | None,
        fmt: str,
        mode: str,
        refund: Callable[[], None],
    ):
        """mode: "audio" (chunked stream), "sse", or "file" (whole file, real status on late failure).

        refund: gives back the client's rate-limit quota; called when the request is refused with 503
        (at capacity, engine queue full, not ready, shutting down): a refused request is not charged.
        """
        try:
            validate_format(fmt)
        except ValueError as e:
            raise bad_request(str(e), param=_fmt_param(endpoint)) from None
        try:
            req, stretch = build_synthesis_request(
                text,
                voice,
                opts,
                speed=speed,
                instructions=instructions,
                max_new_tokens_cap=self.cfg.max_new_tokens,
                request_id=f"{request.state.request_id}-{uuid.uuid4().hex[:8]}",
            )
        except ValueError as e:
            raise bad_request(str(e), param=_http_param(e, text_param)) from None
        self._check_audio_length(text, text_param, speed)
        rate = opts.sample_rate or SAMPLE_RATE
        try:
            release = self.gate.acquire()
        except ApiError as e:
            raise _refunded_if_refused(e, refund) from None
        job = SynthesisJob(
            request.state.request_id,
            endpoint,
            len(text),
            input_rate=self.engine.sample_rate,
            stretch=stretch,
            timeout_s=self.cfg.request_timeout_s,
            timestamps=getattr(opts, "timestamps", None) == "segment",
        )
        if self.cfg.max_audio_seconds is not None:
            job.max_samples = math.ceil(self.cfg.max_audio_seconds * stretch * self.engine.sample_rate)
        request.state.log.update(chars=len(text), voice=voice.name, format=fmt, mode=mode)
        gen = self.engine.generate(req)
        try:
            first = await prime(gen, request, job)
            if mode in ("file", "json"):
                data = await until_disconnect(
                    collect_audio(first, gen, job, fmt, rate, stretch, opts.volume_multiplier), request
                )
        except BaseException as e:
            await gen.aclose()  # aborts the engine request unless it finished
            release()
            self._settle(job, request, error=e)
            raise _refunded_if_refused(_as_api_error(e, text_param), refund) from None
        if mode in ("file", "json"):
            await gen.aclose()
            release()
            self._settle(job, request)
            headers = {
                "X-Finish-Reason": job.finish_reason or "stop",
                "X-Audio-Duration": f"{job.audio_seconds:.3f}",
                "X-Truncated-Segments": ",".join(map(str, job.truncated_segments)),
            }
            if mode == "json":
                return json_response(data, fmt, job, headers)
            return Response(data, media_type=content_type(fmt), headers=headers)
        pipe = AudioPipeline(fmt, rate, self.engine.sample_rate, stretch, opts.volume_multiplier)
        body = (sse_body if mode == "sse" else audio_body)(first, gen, pipe, job)

        async def on_close(error: BaseException | None) -> None:
            await gen.aclose()  # aborts the engine request if it has not finished (client gone, error)
            release()
            self._settle(job, request, error=error)

        media = "text/event-stream" if mode == "sse" else content_type(fmt)
        headers = {"Cache-Control": "no-cache", "X-Request-ID": request.state.request_id}
        return EngineStreamResponse(body, on_close=on_close, media_type=media, headers=headers)

    def _check_audio_length(self, text: str, param: str, speed: float) -> None:
        """400 for text that alone would outlast --max-audio-seconds (a lower bound on its speech, so text that
        passes may still be cut at the ceiling)."""
        cap = self.cfg.max_audio_seconds
        if cap is None:
            return
        seconds = min_speech_seconds(text) / speed
        if seconds > cap:
            raise bad_request(
                f"{param} would take at least {seconds:.0f} s to speak at speed {speed:g}, over the server's limit "
                f"of {cap:g} s of audio per request (estimated from its length: {MAX_UNITS_PER_SECOND:g} CJK "
                f"characters or {MAX_UNITS_PER_SECOND / LATIN_WEIGHT:g} other characters per second); split it "
                f"into several requests",
                param=param,
                code="audio_too_long",
            )

    def _settle(self, job: SynthesisJob, request: Request, error: BaseException | None = None) -> None:
        if job.finish_reason is None:
            job.finish_reason = _unfinished_reason(error)
            job.reason = job.reason or _reason_text(error)
        total = time.perf_counter() - job.started
        self.metrics.observe_synthesis(job.endpoint, job.first_audio_s, total, job.audio_seconds, job.finish_reason)
        request.state.log.update(
            finish_reason=job.finish_reason,
            audio_s=round(job.audio_seconds, 3),
            frames=job.num_frames,
            ttfa_ms=None if job.first_audio_s is None else round(job.first_audio_s * 1000, 1),
            total_ms=round(total * 1000, 1),
        )
        if job.reason:
            request.state.log["reason"] = job.reason
        # For streams the access line was written when the handler returned; log the synthesis outcome too.
        if getattr(request.state, "logged", False):
            access_logger.info(
                json.dumps(
                    {
                        "event": "synthesis_done",
                        "request_id": job.request_id,
                        **{
                            k: request.state.log.get(k)
                            for k in ("finish_reason", "reason", "audio_s", "frames", "ttfa_ms", "total_ms")
                            if k != "reason" or job.reason
                        },
                    }
                )
            )


def _unfinished_reason(error: BaseException | None) -> str:
    """Why a synthesis ended without a final output: the client left, its input was refused, its time ran out,
    or a failure."""
    if isinstance(error, RequestTimeout) or (isinstance(error, ApiError) and error.code == "request_timeout"):
        return "timeout"
    if (
        error is None
        or isinstance(error, (ClientGone, OSError))
        or type(error).__name__ in ("CancelledError", "ClientDisconnect")
    ):
        return "abort"
    if isinstance(error, (ValueError, EngineOverloadedError)) or (isinstance(error, ApiError) and error.status < 500):
        return "rejected"
    return "error"


def _reason_text(error: BaseException | None) -> str:
    """The log's `reason` for a synthesis that ended without all its audio."""
    if error is None or isinstance(error, ClientGone) or type(error).__name__ in ("CancelledError", "ClientDisconnect"):
        return "client disconnected"
    if isinstance(error, OSError):
        return f"connection error: {error}"
    if isinstance(error, ApiError):
        return f"{error.code}: {error.message}"
    if isinstance(error, RequestTimeout):
        return f"request_timeout: {error}"
    return f"{type(error).__name__}: {error}"


def _refunded_if_refused(err: BaseException, refund: Callable[[], None]) -> BaseException:
    """`err`, after giving the rate-limit quota back if it is a 503 (the server refused: no work was done)."""
    if isinstance(err, ApiError) and err.status == 503:
        refund()
    return err


def _fmt_param(endpoint: str) -> str:
    return "format" if endpoint == "synthesize" else "response_format"


def _http_param(e: BaseException, text_param: str) -> str:
    """The HTTP field an invalid request names: a sampling option keeps its name (the HTTP and engine
    names agree); the text, its prompts and anything unnamed are the text field's fault."""
    param = engine_param(e)
    return param if param in _SAMPLING_FIELDS else text_param


def _as_api_error(e: BaseException, text_param: str) -> BaseException:
    if isinstance(e, ApiError):
        return e
    if isinstance(e, ClientGone):
        return ApiError(499, "client closed the request", code="client_closed_request")
    if isinstance(e, RequestTimeout):
        return ApiError(504, str(e), code="request_timeout")
    return engine_error(e, _http_param(e, text_param))


# ---- the app -------------------------------------------------------------------------------------
def _fix_openapi(app: FastAPI, max_input_chars: int) -> None:
    """FastAPI documents a 422 for every route with a body; ours answer 400 (errors.validation_error). The
    JSON body of POST /v1/audio/voices is parsed by hand (it shares the route with multipart uploads), so
    its schema is added to the components the route's document refers to. The text fields get this server's
    --max-input-chars as their maxLength."""
    default_openapi = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = default_openapi()
            for path in schema.get("paths", {}).values():
                for op in path.values():
                    op.get("responses", {}).pop("422", None)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            components["VoiceCreateJSON"] = VoiceCreateJSON.model_json_schema(
                ref_template="#/components/schemas/{model}"
            )
            for model, field in (("SpeechRequest", "input"), ("SynthesizeRequest", "text")):
                prop = components.get(model, {}).get("properties", {}).get(field)
                if prop is not None:
                    prop["maxLength"] = max_input_chars
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def create_app(engine: EngineClient, cfg: ServerConfig | None = None, *, rate_limiter=None) -> FastAPI:
    """The ASGI app serving `engine`.

    rate_limiter: anything with RateLimiter's `check(identity, num_chars)` (default: a RateLimiter of this
    process from cfg's limits); API servers of one engine core share one (server/shared_limits.py).
    """
    cfg = cfg or ServerConfig()
    st = ServerState(engine, cfg, rate_limiter)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        await warm_up_api_server(st)
        logger.info("ttsserve ready: %s", engine.memory_report())
        log_ready(app, cfg)
        try:
            yield
        finally:
            st.gate.closed = True
            await engine.shutdown(cfg.drain_timeout_s)
            st.store.close()

    app = FastAPI(
        title="ttsserve",
        version="0.1.0",
        lifespan=lifespan,
        description="ChatTTS serving: OpenAI-compatible speech API, voices, streaming audio.",
        docs_url=None,  # server/playground.py serves /docs and /redoc from local assets
        redoc_url=None,
    )
    app.state.server = st
    app.state.drain = DrainState()  # started by drain.DrainingServer on SIGTERM
    install_error_handlers(app)
    bearer = HTTPBearer(auto_error=False, description="API key (only when the server has --api-key)")

    async def identity(request: Request, _=Depends(bearer)) -> str:  # async: a sync one runs in a worker thread
        return st.identity(request)

    @app.post(
        "/v1/audio/speech",
        responses={200: _AUDIO_200 | {"content": {**_AUDIO_TYPES, "text/event-stream": {}}}, **_ERRORS},
        response_class=Response,
        tags=["speech"],
    )
    async def create_speech(body: SpeechRequest, request: Request, ident: str = Depends(identity)):
        """OpenAI speech: audio streamed as it is produced (`stream_format` audio) or SSE events (`sse`);
        `stream: false` sends the whole file instead."""
        st.extra_fields.check(request, body)
        mode = speech_mode(body)
        refund = st.admit_text(body.input, ident, "input")
        st.check_model(body.model)
        voice = st.resolve_voice(body.voice, scope=request.state.voice_scope)
        return await st.synthesize(
            request,
            endpoint="speech",
            text=body.input,
            text_param="input",
            voice=voice,
            opts=body,
            speed=body.speed,
            instructions=body.instructions,
            fmt=body.response_format,
            mode=mode,
            refund=refund,
        )

    @app.post("/synthesize", responses={200: _AUDIO_200, **_ERRORS}, response_class=Response, tags=["speech"])
    async def synthesize(body: SynthesizeRequest, request: Request, ident: str = Depends(identity)):
        """Simple API: JSON in, the whole audio file out (or a chunked stream with `stream: true`)."""
        st.extra_fields.check(request, body)
        refund = st.admit_text(body.text, ident, "text")
        voice = st.resolve_voice(body.voice, scope=request.state.voice_scope)
        return await st.synthesize(
            request,
            endpoint="synthesize",
            text=body.text,
            text_param="text",
            voice=voice,
            opts=body,
            speed=body.speed,
            instructions=None,
            fmt=body.format,
            mode="audio" if body.stream else "file",
            refund=refund,
        )

    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS, tags=["models"])
    async def list_models(_: str = Depends(identity)):
        return ModelList(data=[ModelObject(id=n, created=st.created) for n in st.model_names])

    @app.get("/v1/models/{model}", response_model=ModelObject, responses=_ERRORS, tags=["models"])
    async def get_model(model: str, _: str = Depends(identity)):
        st.check_model(model)
        return ModelObject(id=model, created=st.created)

    register_voice_routes(app, st, identity, _ERRORS)
    register_playground(app)
    register_compat_routes(app, st, identity, _ERRORS)

    @app.get("/health", tags=["ops"], responses={503: {"model": ErrorResponse}})
    async def health():
        if engine.dead:  # gone (its process or thread), or stalled: a step that does not end
            code = "engine_stalled" if getattr(engine, "stalled", False) else "engine_dead"
            raise ApiError(503, engine.dead_reason or "the engine is gone", code=code)
        return {"status": "ok"}

    @app.get("/ready", tags=["ops"], responses={503: {"model": ErrorResponse}})
    async def ready():
        if not engine.ready or st.gate.closed:
            why = (engine.dead_reason if engine.dead else None) or "engine not ready"
            raise ApiError(503, why, code="not_ready", headers={"Retry-After": "1"})
        return {"status": "ready", "model": st.model_names[0]}

    @app.get("/metrics", tags=["ops"], response_class=Response)
    async def metrics():
        return Response(st.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    _fix_openapi(app, cfg.max_input_chars)
    if cfg.auth_docs_and_metrics and st.auth.enabled:
        docs = ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json", "/metrics")
        app.add_middleware(KeyRequiredMiddleware, auth=st.auth, paths=docs)
    app.add_middleware(
        BodyLimitMiddleware,
        max_body_bytes=cfg.max_body_bytes,
        max_upload_bytes=cfg.max_upload_bytes,
        upload_paths=("/v1/audio/voices",),
    )
    app.add_middleware(IgnoredFieldsHeader)
    add_cors(app, cfg)
    app.add_middleware(RequestContextMiddleware, metrics=st.metrics)
    app.add_middleware(DrainMiddleware, state=app.state.drain)  # outermost: a draining server answers first
    return app

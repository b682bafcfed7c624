"""The FastAPI app: OpenAI-compatible speech, the simple /synthesize API, voices, models and operations.

`create_app(engine, cfg)` serves any EngineClient (engine/protocol.py): the in-process AsyncEngine, an API
server's CoreClient, or a test fake. The app starts the engine in its lifespan and drains it on shutdown;
a dead engine turns /health into a 503. Engine errors become HTTP errors through server/errors.engine_error.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from fastapi.security import HTTPBearer

from ttsserve.engine.protocol import EngineClient
from ttsserve.server.access_log import RequestContextMiddleware
from ttsserve.server.args import ServerConfig
from ttsserve.server.compat import (
    IgnoredFieldsHeader,
    add_cors,
    log_ready,
    register_compat_routes,
    speech_mode,
)
from ttsserve.server.drain import DrainMiddleware, DrainState
from ttsserve.server.errors import (
    ApiError,
    install_error_handlers,
)
from ttsserve.server.limits import (
    BodyLimitMiddleware,
    KeyRequiredMiddleware,
)
from ttsserve.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from ttsserve.server.playground import register_playground
from ttsserve.server.profile_routes import register_profile_routes
from ttsserve.server.protocol import (
    ErrorResponse,
    ModelList,
    ModelObject,
    SpeechRequest,
    SynthesizeRequest,
    VoiceCreateJSON,
)
from ttsserve.server.serving import AUDIO_200, AUDIO_TYPES, ERROR_RESPONSES, ServerState
from ttsserve.server.voice_routes import register_voice_routes
from ttsserve.server.warm_start import warm_up_api_server

logger = logging.getLogger("ttsserve.server")


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
        responses={200: AUDIO_200 | {"content": {**AUDIO_TYPES, "text/event-stream": {}}}, **ERROR_RESPONSES},
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
        voice = await st.resolve_voice(body.voice, scope=request.state.voice_scope)
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

    @app.post("/synthesize", responses={200: AUDIO_200, **ERROR_RESPONSES}, response_class=Response, tags=["speech"])
    async def synthesize(body: SynthesizeRequest, request: Request, ident: str = Depends(identity)):
        """Simple API: JSON in, the whole audio file out (or a chunked stream with `stream: true`)."""
        st.extra_fields.check(request, body)
        refund = st.admit_text(body.text, ident, "text")
        voice = await st.resolve_voice(body.voice, scope=request.state.voice_scope)
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

    @app.get("/v1/models", response_model=ModelList, responses=ERROR_RESPONSES, tags=["models"])
    async def list_models(_: str = Depends(identity)):
        return ModelList(data=[ModelObject(id=n, created=st.created) for n in st.model_names])

    @app.get("/v1/models/{model}", response_model=ModelObject, responses=ERROR_RESPONSES, tags=["models"])
    async def get_model(model: str, _: str = Depends(identity)):
        st.check_model(model)
        return ModelObject(id=model, created=st.created)

    register_voice_routes(app, st, identity, ERROR_RESPONSES)
    register_playground(app)
    register_compat_routes(app, st, identity, ERROR_RESPONSES)
    register_profile_routes(app, st, ERROR_RESPONSES)

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
        return {"status": "ready", "model": st.model_names[0], "cores": engine.cores()}

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

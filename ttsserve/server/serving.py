"""The speech request path every endpoint shares: admission (key, size, rate limits), model and voice checks, the
engine request and its response (a file, a chunked stream, SSE or JSON), and the outcome's accounting.

`ServerState` is one per app (server/app.py builds it and registers the routes); its `synthesize` is the one
place a speech request meets the engine (an EngineClient, engine/protocol.py).
"""

from __future__ import annotations

import json
import logging
import math
import time
import uuid
from collections.abc import Callable

from fastapi import Request
from fastapi.responses import Response

from ttsserve.audio.encode import FORMATS, content_type, validate_format
from ttsserve.constants import SAMPLE_RATE
from ttsserve.engine.errors import EngineOverloadedError
from ttsserve.engine.protocol import EngineClient
from ttsserve.server.access_log import access_logger
from ttsserve.server.args import ServerConfig
from ttsserve.server.compat import (
    ExtraFields,
)
from ttsserve.server.errors import (
    ApiError,
    bad_request,
    engine_error,
    engine_param,
)
from ttsserve.server.limits import (
    AdmissionGate,
    ApiKeyAuth,
    RateLimiter,
)
from ttsserve.server.metrics import ServerMetrics
from ttsserve.server.protocol import (
    ChatTTSOptions,
    ErrorResponse,
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
from ttsserve.server.voice_routes import off_loop
from ttsserve.server.voice_store import open_voice_store
from ttsserve.server.voices import UnknownVoiceError, VoiceResolver, VoiceScope
from ttsserve.text.split import LATIN_WEIGHT, MAX_UNITS_PER_SECOND, min_speech_seconds

logger = logging.getLogger("ttsserve.server")

OPENAI_MODEL_NAMES = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "repetition_penalty", "max_new_tokens", "min_new_tokens", "seed")
ERROR_RESPONSES = {s: {"model": ErrorResponse} for s in (400, 401, 403, 404, 413, 429, 500, 503, 504)}
AUDIO_TYPES = {content_type(f): {"schema": {"type": "string", "format": "binary"}} for f in FORMATS}
AUDIO_200 = {"description": "the audio, in the requested format", "content": AUDIO_TYPES}


class ServerState:
    """Everything the handlers share; one per app."""

    def __init__(self, engine: EngineClient, cfg: ServerConfig, rate_limiter=None) -> None:
        self.engine = engine
        self.cfg = cfg
        self.auth = ApiKeyAuth(cfg.api_keys, cfg.admin_api_keys)
        self.rate = rate_limiter or RateLimiter(cfg.requests_per_minute, cfg.chars_per_minute)
        self.gate = AdmissionGate(cfg.max_in_flight)
        self.metrics = ServerMetrics(engine.stats, (cfg.served_model_names or (engine.model_name,))[0])
        self.store = open_voice_store(cfg.voices_db)
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

    async def resolve_voice(self, spec, param: str = "voice", scope: VoiceScope = VoiceScope()):  # noqa: B008 - frozen
        """The engine Voice of a request's voice spec; 400/404 naming `param`, 503 if the store is unreachable.
        Built-in names, seeds and speaker strings resolve here; a stored voice's lookup runs off the loop."""
        try:
            if self.voices.needs_store(spec):
                voice = await off_loop(self.voices.resolve, spec, scope)
            else:
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
        arrived = getattr(request.state, "arrived", None)  # RequestContextMiddleware's clock
        if arrived is not None:
            request.state.log["admit_ms"] = round((job.started - arrived) * 1000, 1)
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

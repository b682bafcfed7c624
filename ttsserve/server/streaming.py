"""Engine audio -> HTTP bodies: one continuous encoder per response, raw audio or SSE, abort on disconnect.

Flow of one synthesis: `prime()` waits for the first audio (so input errors become a 4xx before any header
is sent), then `audio_body()` / `sse_body()` turn the rest of the engine's AudioOutput stream into bytes.
`EngineStreamResponse` always watches for the client going away: it cancels the body, which closes the
engine's generator, which aborts the request and frees its KV blocks at the next engine step.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import anyio
import numpy as np
from starlette.requests import Request
from starlette.responses import StreamingResponse

from ttsserve.audio.encode import StreamingEncoder, encode_audio
from ttsserve.audio.post import apply_gain
from ttsserve.audio.speed import StreamTimeStretcher
from ttsserve.constants import SAMPLE_RATE
from ttsserve.server.errors import ApiError
from ttsserve.server.timestamps import take_ready_segments

logger = logging.getLogger("ttsserve.server")


class ClientGone(Exception):
    """The client disconnected before the response started."""


class RequestTimeout(Exception):
    """The request ran past --request-timeout (504 before any audio; a cut stream after)."""


@dataclass
class SynthesisJob:
    """Progress of one synthesis from admission to its last byte (feeds metrics and the access log)."""

    request_id: str
    endpoint: str
    num_chars: int
    input_rate: int = SAMPLE_RATE
    stretch: float = 1.0  # residual speed factor applied to the engine's audio
    started: float = field(default_factory=time.perf_counter)
    first_audio_s: float | None = None  # seconds from start to the first non-empty audio bytes
    num_samples: int = 0  # engine samples received, at input_rate
    num_frames: int = 0
    finish_reason: str | None = None
    truncated_segments: list[int] = field(default_factory=list)
    error: str | None = None
    timeout_s: float | None = None  # from `started` to the last output (--request-timeout)
    max_samples: int | None = None  # engine samples (input_rate) delivered at most (--max-audio-seconds)
    reason: str | None = None  # why it ended without all its audio (the log line's `reason`)
    timestamps: bool = False  # collect the engine's segment spans (server/timestamps.py)
    spans: list = field(default_factory=list)  # SegmentSpans received and not yet sent

    @property
    def audio_seconds(self) -> float:
        """Duration of the audio delivered (after the speed stretch)."""
        return self.num_samples / self.input_rate / self.stretch

    def observe(self, out):
        """Account for `out`; returns it, cut at max_samples (then final, finish_reason "length")."""
        if self.max_samples is not None and self.num_samples + out.samples.size >= self.max_samples:
            if out.samples.size > self.max_samples - self.num_samples or not out.finished:
                keep = self.max_samples - self.num_samples
                out = dataclasses.replace(out, samples=out.samples[:keep], finished=True, finish_reason="length")
        self.num_samples += int(out.samples.size)
        if self.timestamps:
            self.spans.extend(out.segments)
        self.num_frames = max(self.num_frames, int(out.num_frames))
        if out.finished:
            self.finish_reason = out.finish_reason or "stop"
            self.truncated_segments = list(out.truncated_segments or [])
            self.error = out.error
        return out

    async def next_output(self, gen: AsyncIterator):
        """The engine's next output, observed; RequestTimeout once the request's time is up."""
        if self.timeout_s is None:
            out = await anext(gen)
        else:
            left = self.started + self.timeout_s - time.perf_counter()
            try:
                out = await asyncio.wait_for(anext(gen), max(left, 0.0))
            except TimeoutError:
                raise RequestTimeout(
                    f"the request did not finish in {self.timeout_s:g} s (--request-timeout)"
                ) from None
        return self.observe(out)

    def mark_first_audio(self) -> None:
        if self.first_audio_s is None:
            self.first_audio_s = time.perf_counter() - self.started

    def usage(self) -> dict:
        # The engine does not report text tokens; input_tokens counts characters (documented).
        return {
            "input_tokens": self.num_chars,
            "output_tokens": self.num_frames,
            "total_tokens": self.num_chars + self.num_frames,
        }


class AudioPipeline:
    """Per-response post-processing: residual time stretch (speed), then resample + container encoding.

    `push(samples [n] float32 at input_rate) -> bytes`, `finish() -> bytes`; the concatenation is one file.
    """

    def __init__(self, fmt: str, sample_rate: int, input_rate: int, stretch: float, gain: float = 1.0) -> None:
        self._stretcher = StreamTimeStretcher(stretch, input_rate) if abs(stretch - 1.0) > 1e-6 else None
        self._encoder = StreamingEncoder(fmt, sample_rate, input_rate=input_rate)
        self._gain = gain

    def push(self, samples: np.ndarray) -> bytes:
        if self._stretcher is not None:
            samples = self._stretcher.process(samples)
        return self._encoder.write(apply_gain(samples, self._gain)) if samples.size else b""

    def finish(self) -> bytes:
        out = b""
        if self._stretcher is not None:
            tail = self._stretcher.flush()
            if tail.size:
                out = self._encoder.write(apply_gain(tail, self._gain))
        return out + self._encoder.close()


async def prime(gen: AsyncIterator, request: Request | None, job: SynthesisJob) -> list:
    """Read outputs until the first with audio (or the final one), watching for a disconnect meanwhile.

    Returns those outputs; the last has audio (so the response is never empty) or is the final one of a
    synthesis that has some. Raises ValueError (bad input), the engine's overload error, ClientGone,
    ApiError(500) for an engine error before any audio, or `no_audio_error` (500) when the synthesis ended
    without a single sample. Every response mode primes before it sends headers, so each of these is a
    real status, streams included. On any raise the generator is closed (aborted).
    """
    outs: list = []
    try:
        while True:
            try:
                out = await until_disconnect(job.next_output(gen), request)
            except StopAsyncIteration:
                raise ApiError(500, "engine stream ended without a final output", code="engine_error") from None
            outs.append(out)
            if out.finished and out.finish_reason == "error":
                raise ApiError(500, f"synthesis failed: {out.error or 'engine error'}", code="engine_error")
            if out.finished and not job.num_samples:
                raise no_audio_error(job)
            if out.finished or out.samples.size:
                return outs
    except BaseException:
        await gen.aclose()
        raise


def no_audio_error(job: SynthesisJob) -> ApiError:
    """A synthesis that ended without one sample (EOS sampled at the first step) failed: a 200 carrying an
    empty file would pass every status check and play as nothing. 500 as OpenAI answers for unusable model
    output; clients (the openai SDK among them) retry a 500, and an unseeded retry draws a new seed."""
    job.finish_reason = "error"  # metrics and the access log count it as a failed synthesis
    where = "at the first step" if job.num_frames == 0 else f"after {job.num_frames} frames"
    return ApiError(
        500,
        f"the model produced no audio (EOS {where}); retry, with another seed if you set one, or "
        f"set min_new_tokens >= 1 to forbid an immediate EOS",
        code="no_audio",
    )


async def until_disconnect(aw: Awaitable, request: Request | None):
    """Await `aw`, cancelling it and raising ClientGone if the client disconnects first.

    Only valid once the request body has been read (the next ASGI message can then only be the disconnect).
    """
    task = asyncio.ensure_future(aw)
    if request is None:
        return await task
    gone = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # we were cancelled (server shutdown): do not leave the work running
        task.cancel()
        raise
    finally:
        gone.cancel()
    if not task.done():
        task.cancel()  # CancelledError inside the engine generator: its finally aborts the request
        await asyncio.gather(task, return_exceptions=True)
        raise ClientGone()
    return task.result()


async def _wait_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message on this connection can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _outputs(first: list, gen: AsyncIterator, job: SynthesisJob):
    for out in first:
        yield out
    if first and first[-1].finished:
        return
    while True:
        try:
            out = await job.next_output(gen)
        except StopAsyncIteration:
            return
        yield out
        if out.finished:
            return


def _check_final(out, job: SynthesisJob) -> None:
    if out.finished and out.finish_reason == "error":
        # Headers (200) are out already: the only honest signal left is to break the stream.
        raise RuntimeError(f"synthesis {job.request_id} failed mid-stream: {out.error}")


async def audio_body(first: list, gen: AsyncIterator, pipe: AudioPipeline, job: SynthesisJob) -> AsyncIterator[bytes]:
    """Encoded audio bytes as the engine produces them (chunked transfer)."""
    async for out in _outputs(first, gen, job):
        _check_final(out, job)
        data = pipe.push(out.samples)
        if data:
            job.mark_first_audio()
            yield data
    tail = pipe.finish()
    if tail:
        job.mark_first_audio()
        yield tail


def sse_event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _sse_error(message: str, code: str) -> bytes:
    return sse_event(
        {"type": "error", "error": {"message": message, "type": "server_error", "param": None, "code": code}}
    )


async def sse_body(first: list, gen: AsyncIterator, pipe: AudioPipeline, job: SynthesisJob) -> AsyncIterator[bytes]:
    """OpenAI speech SSE: `speech.audio.delta` events (base64 of the encoded stream), with timestamps a
    `speech.segment` event once a segment's audio is out, then `speech.audio.done`.
    A failure after the first event is an `error` event, then the stream breaks off (no `done`)."""
    try:
        async for out in _outputs(first, gen, job):
            if out.finished and out.finish_reason == "error":
                yield _sse_error(f"synthesis failed: {out.error}", "engine_error")
                _check_final(out, job)
            data = pipe.push(out.samples)
            if data:
                job.mark_first_audio()
                yield sse_event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})
            for seg in take_ready_segments(job) if job.timestamps else ():
                yield sse_event({"type": "speech.segment", **seg})
    except RequestTimeout as e:
        yield _sse_error(str(e), "request_timeout")
        raise
    tail = pipe.finish()
    if tail:
        job.mark_first_audio()
        yield sse_event({"type": "speech.audio.delta", "audio": base64.b64encode(tail).decode()})
    for seg in take_ready_segments(job, final=True) if job.timestamps else ():
        yield sse_event({"type": "speech.segment", **seg})
    yield sse_event(
        {
            "type": "speech.audio.done",
            "usage": job.usage(),
            "finish_reason": job.finish_reason,
            "truncated_segments": job.truncated_segments,
        }
    )


async def collect_audio(
    first: list,
    gen: AsyncIterator,
    job: SynthesisJob,
    fmt: str,
    sample_rate: int,
    stretch: float,
    gain: float = 1.0,
) -> bytes:
    """The whole file (non-streamed): real sizes in the headers. ApiError(500) if the engine fails."""
    chunks = []
    async for out in _outputs(first, gen, job):
        if out.finished and out.finish_reason == "error":
            raise ApiError(500, f"synthesis failed: {out.error or 'engine error'}", code="engine_error")
        chunks.append(out.samples)
    x = np.concatenate(chunks).astype(np.float32, copy=False) if chunks else np.zeros(0, np.float32)
    if abs(stretch - 1.0) > 1e-6:
        st = StreamTimeStretcher(stretch, job.input_rate)
        x = np.concatenate([st.process(x), st.flush()])
    data = encode_audio(apply_gain(x, gain), fmt, sample_rate, input_rate=job.input_rate)
    job.mark_first_audio()
    return data


class EngineStreamResponse(StreamingResponse):
    """A StreamingResponse that (1) always listens for the client's disconnect and then cancels the body,
    whatever ASGI spec version the server speaks, and (2) always runs `on_close` exactly once, even when the
    body never started, so the engine request, admission slot and metrics are settled on every path.
    """

    def __init__(
        self, content: AsyncIterator[bytes], *, on_close: Callable[[BaseException | None], Awaitable[None]], **kw
    ):
        super().__init__(content, **kw)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        error: BaseException | None = None
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    await self.stream_response(send)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        except BaseException as e:  # noqa: BLE001 - re-raised below after settling
            error = e.exceptions[0] if isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1 else e
            raise error from None
        finally:
            try:
                await self.body_iterator.aclose()
            finally:
                await self._on_close(error)

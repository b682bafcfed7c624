"""Segment-level timestamps for `POST /v1/audio/speech` (`"timestamps": "segment"`).

Every text segment (text/split.py) is generated as its own sequence, and the engine reports where each one
lies in the output stream (engine/synthesis.SegmentSpan, in engine samples), so these times are exact: not
estimated from text length, not measured by an aligner. Times are seconds of the delivered audio: engine
samples / engine rate / the residual speed stretch (resampling to `sample_rate` does not move them). A segment
after the first starts inside the previous one's end by the crossfade (20 ms at most). There are no word
timestamps: nothing here measures word boundaries (that would need a forced aligner).

Two ways to get them:
  - `stream_format: "sse"`: a `speech.segment` event per segment, in order, once its audio went out, all
    before `speech.audio.done`;
  - `stream_format` left out: one JSON body {"audio": base64 of the whole file, "content_type", "segments"}
    (the shape of Kokoro-FastAPI's captioned speech), since a raw audio body has nowhere to put them.
    `stream_format: "audio"` asks for exactly that raw body, so with timestamps it is a 400.
"""

from __future__ import annotations

import base64

from fastapi.responses import JSONResponse

from ttsserve.audio.encode import content_type
from ttsserve.server.errors import bad_request


def timestamps_mode(body) -> str:
    """The response mode of a speech request: "audio" or "sse" (stream_format), or "json" (timestamps
    without a stream_format). ApiError 400 (param "timestamps") where timestamps cannot be delivered."""
    if body.timestamps is None:
        return body.stream_format
    if body.stream_format == "sse":
        return "sse"
    if "stream_format" in body.model_fields_set:
        raise bad_request(
            'timestamps need stream_format "sse" (speech.segment events) or no stream_format (a JSON body '
            "with the audio and its segments); a raw audio stream has nowhere to carry them",
            param="timestamps",
        )
    return "json"


def _seconds(samples: int, job) -> float:
    return round(samples / job.input_rate / job.stretch, 6)


def segment_dict(span, job) -> dict:
    """A span (engine samples) as the client sees it: seconds of delivered audio, cut where the audio was."""
    return {
        "text": span.text,
        "start": _seconds(span.start, job),
        "end": _seconds(min(span.end, job.num_samples), job),
    }


def take_ready_segments(job, final: bool = False) -> list[dict]:
    """The segments whose audio has all been delivered (with `final`: every one that began before the
    audio ended), in order; each is taken once."""
    out: list[dict] = []
    while job.spans and (job.spans[0].end <= job.num_samples or final):
        span = job.spans.pop(0)
        if span.start < job.num_samples or span.start == 0:
            out.append(segment_dict(span, job))
    return out


def json_response(data: bytes, fmt: str, job, headers: dict[str, str]) -> JSONResponse:
    """The whole file and its segments in one JSON body."""
    body = {
        "audio": base64.b64encode(data).decode(),
        "content_type": content_type(fmt),
        "segments": take_ready_segments(job, final=True),
    }
    return JSONResponse(body, headers=headers)

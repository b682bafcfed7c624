"""Segment timestamps (`"timestamps": "segment"` on /v1/audio/speech) through a real `serve` on the tiny model,
in one process and with --api-server-count 2: SSE `speech.segment` events and the JSON body with base64 audio.

The times must be exact: the last segment ends where the delivered audio ends (within one output sample), the
segments follow each other up to the 20 ms crossfade, and their texts are the normalized input."""

from __future__ import annotations

import base64
import itertools

import httpx
import pytest

from tests.server.helpers import decode, parse_sse, sse_audio
from tests.server.multiproc_helpers import ServeProcess
from ttsserve.engine.synthesis import CROSSFADE_SAMPLES
from ttsserve.text.normalize import normalize_text

_SENTENCE = (
    "The quick brown fox jumps over the lazy dog while the farmer watches from the porch and wonders whether the"
    " rain will come before the harvest is finished in 2024, because the clouds in the west look heavy and dark."
)
# three sentences too long to share a segment (text/split.py packs up to ~300 Latin characters)
TEXT = " ".join([_SENTENCE.replace("quick", "slow"), _SENTENCE, _SENTENCE.replace("fox", "cat")])
BODY = {"model": "tts-1", "input": TEXT, "voice": "alloy", "seed": 5, "min_new_tokens": 4, "timestamps": "segment"}
RATE = 24000


@pytest.fixture(scope="module", params=[0, 2], ids=["one-process", "api-servers-2"])
def server(request, tmp_path_factory):
    srv = ServeProcess(tmp_path_factory.mktemp("ts"), "--voices-db", ":memory:", count=request.param)
    try:
        srv.wait_ready()
        with httpx.Client(base_url=srv.url, timeout=60) as client:
            yield client
    finally:
        assert srv.stop() == 0, srv.log()


def _check_segments(segs: list[dict], duration: float, rate: int, stretch: float = 1.0) -> None:
    assert len(segs) >= 3
    assert segs[0]["start"] == 0
    assert abs(segs[-1]["end"] - duration) <= 1 / rate + 1e-6, (segs[-1], duration)
    for a, b in itertools.pairwise(segs):
        assert a["start"] <= b["start"] <= a["end"] <= b["end"]  # in order
        assert a["end"] - b["start"] <= CROSSFADE_SAMPLES / RATE / stretch + 1e-6  # contiguous up to the fade
    assert " ".join(s["text"] for s in segs) == normalize_text(TEXT, expand_numbers=True).text.strip()


def _json(client: httpx.Client, **extra) -> tuple[list[dict], float, int]:
    r = client.post("/v1/audio/speech", json={**BODY, **extra})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    fmt = extra.get("response_format", "mp3")
    assert body["content_type"].startswith("audio/")
    rate = extra.get("sample_rate", RATE)
    audio, rate = decode(base64.b64decode(body["audio"]), fmt, pcm_rate=rate)
    return body["segments"], audio.size / rate, rate


def test_sse_segment_events_time_the_stream(server):
    r = server.post("/v1/audio/speech", json={**BODY, "stream_format": "sse", "response_format": "pcm"})
    assert r.status_code == 200, r.text
    events = parse_sse(r.content)
    kinds = [e["type"] for e in events]
    assert kinds[-1] == "speech.audio.done" and kinds.count("speech.audio.done") == 1
    segs = [{k: e[k] for k in ("text", "start", "end")} for e in events if e["type"] == "speech.segment"]
    duration = len(sse_audio(events)) / 2 / RATE
    _check_segments(segs, duration, RATE)
    # the same seeded request as one JSON body: the same audio, the same segments
    json_segs, json_duration, _ = _json(server, response_format="pcm")
    assert json_segs == segs and json_duration == duration


def test_json_body_with_wav_at_another_rate(server):
    segs, duration, rate = _json(server, response_format="wav", sample_rate=16000)
    assert rate == 16000
    _check_segments(segs, duration, rate)


def test_speed_scales_the_times(server):
    # speed 2.0 and 4.0 both ask the model for [speed_9]: the same audio from the engine, stretched 2x apart
    half, d4, _ = _json(server, response_format="pcm", speed=4.0)
    full, d2, _ = _json(server, response_format="pcm", speed=2.0)
    _check_segments(full, d2, RATE, stretch=2.0 / 1.4)
    _check_segments(half, d4, RATE, stretch=4.0 / 1.4)
    for a, b in zip(full, half, strict=True):
        assert abs(a["start"] / 2 - b["start"]) <= 1e-6 and abs(a["end"] / 2 - b["end"]) <= 1e-6


@pytest.mark.parametrize(
    "extra",
    [{"stream_format": "audio"}, {"timestamps": "word"}, {"timestamps": True}],
    ids=["raw-stream", "word", "not-a-string"],
)
def test_timestamps_that_cannot_be_honoured_are_a_400(server, extra):
    r = server.post("/v1/audio/speech", json={**BODY, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "timestamps"


@pytest.mark.parametrize("stream_format", ["sse", None])
def test_a_segment_cut_short_by_max_audio_seconds_has_no_times(serve, stream_format):
    # the fake speaks its text as one segment: 30 chars -> 2.56 s, cut at 2.2 s before the segment ended
    srv, _ = serve(max_audio_seconds=2.2, max_new_tokens=10_000)
    body = {**BODY, "input": "a" * 30, "response_format": "pcm"}
    if stream_format:
        body["stream_format"] = stream_format
    with srv.client() as c:
        r = c.post("/v1/audio/speech", json=body)
        whole = c.post("/v1/audio/speech", json={**body, "input": "a" * 20})  # 1.71 s: not cut
    assert r.status_code == 200 == whole.status_code, r.text
    if stream_format:
        events = parse_sse(r.content)
        assert events[-1]["type"] == "speech.audio.done" and events[-1]["finish_reason"] == "length"
        segs, audio = [e for e in events if e["type"] == "speech.segment"], sse_audio(events)
        whole_segs = [e for e in parse_sse(whole.content) if e["type"] == "speech.segment"]
    else:
        segs, audio = r.json()["segments"], base64.b64decode(r.json()["audio"])
        whole_segs = whole.json()["segments"]
    assert len(audio) / 2 / RATE == pytest.approx(2.2, abs=1 / RATE)
    assert segs == []  # its end was never generated
    assert [(s["text"], s["start"], s["end"]) for s in whole_segs] == [("a" * 20, 0, round(20 * 4 * 512 / RATE, 6))]

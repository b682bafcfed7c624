"""Hostile request bodies over a real server: JSON that json.loads cannot take (too deep, too many digits,
not UTF-8) is an OpenAI-shaped 400 on every JSON route, logged as 400; an unexpected error is logged as
the 500 the client gets, not as a client that left (499)."""

from __future__ import annotations

import json
import logging

from tests.server.fake_engine import FakeEngine

JSON_ROUTES = ("/v1/audio/voices", "/v1/audio/speech", "/synthesize")
# body -> what the error message says about it
BAD_JSON = {
    b"[" * 100_000: "nested too deeply",  # RecursionError inside json.loads
    b"[" * 100_000 + b"]" * 100_000: "nested too deeply",
    b'{"name": "v", "voice": "alloy", "seed": ' + b"[" * 50_000 + b"]" * 50_000 + b"}": "nested too deeply",
    b"1" * 100_000: "digits",  # ValueError: over sys.get_int_max_str_digits()
    b'{"name": "v", "model": "tts-1", "seed": ' + b"1" * 100_000 + b"}": "digits",
    b'{"name": "v\xff"}': "UTF-8",
    b'{"name": ': "Expecting value",  # plain JSONDecodeError, as before
}


def _access_statuses(caplog) -> dict[str, int]:
    lines = [json.loads(m) for m in caplog.messages if m.startswith('{"event": "access"')]
    return {line["request_id"]: line["status"] for line in lines}


def test_unparseable_json_is_a_400_on_every_json_route(serve, caplog):
    caplog.set_level(logging.INFO, logger="ttsserve.access")
    srv, _ = serve()
    sent = []
    with srv.client() as c:  # one keep-alive connection throughout: a 500 from an unhandled error reset it
        for path in JSON_ROUTES:
            for i, (body, why) in enumerate(BAD_JSON.items()):
                rid = f"bad{path.replace('/', '.')}.{i}"
                r = c.post(path, content=body, headers={"content-type": "application/json", "x-request-id": rid})
                assert r.status_code == 400, (path, body[:50], r.text)
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"}
                assert err["type"] == "invalid_request_error" and err["code"] == "invalid_json", err
                assert err["message"].startswith("request body is not valid JSON") and why in err["message"]
                sent.append(rid)
        assert c.post("/v1/audio/voices", json={"name": "after", "seed": 1}).status_code == 200
    statuses = _access_statuses(caplog)
    assert {rid: statuses.get(rid) for rid in sent} == dict.fromkeys(sent, 400)


class _BrokenSpeakers(FakeEngine):
    def random_speaker(self, seed: int):
        raise RuntimeError("injected failure")


def test_an_unexpected_error_is_logged_as_the_500_it_is(serve, caplog):
    caplog.set_level(logging.INFO, logger="ttsserve.access")
    srv, _ = serve(_BrokenSpeakers())
    with srv.client() as c:
        r = c.post("/v1/audio/voices", json={"name": "x", "seed": 5}, headers={"x-request-id": "broken.1"})
        assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
    with srv.client() as c:  # uvicorn closes a connection whose app raised (Starlette re-raises after the 500)
        metrics = c.get("/metrics").text
    assert _access_statuses(caplog)["broken.1"] == 500
    assert 'ttsserve_requests_total{endpoint="/v1/audio/voices",status="500"} 1.0' in metrics

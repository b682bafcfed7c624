"""The in-process engine's liveness: a step that does not end (a hung device call, a deadlock) turns /health and
/ready to 503 `engine_stalled` within --engine-stall-timeout and refuses new requests with 503 `engine_dead`
instead of queueing them behind it; when the step ends after all, the server serves again."""

from __future__ import annotations

import threading

from tests.server.conftest import make_real_engine, wait_until

SPEECH = {"model": "tts-1", "input": "Hello there.", "voice": "alloy", "response_format": "pcm", "seed": 5}


def test_a_hung_step_is_seen_as_stalled_and_clears_when_it_ends(serve):
    eng = make_real_engine()
    eng.liveness.stall_timeout_s = 1.0
    release = threading.Event()
    step = eng.core.step

    def hung_step(*args, **kwargs):
        assert release.wait(30)
        return step(*args, **kwargs)

    eng.core.step = hung_step
    srv, _ = serve(eng)
    got: dict = {}

    def held() -> None:
        with srv.client() as c:
            got["status"] = c.post("/v1/audio/speech", json=SPEECH).status_code

    t = threading.Thread(target=held)
    try:
        with srv.client() as c:
            assert c.get("/health").status_code == 200
            t.start()

            def stalled() -> bool:
                r = c.get("/health")
                return r.status_code == 503 and r.json()["error"]["code"] == "engine_stalled"

            assert wait_until(stalled, timeout=5, interval=0.05)
            r = c.get("/ready")
            assert r.status_code == 503 and "stalled" in r.json()["error"]["message"]
            r = c.post("/v1/audio/speech", json=SPEECH)
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", r.text
            release.set()
            t.join(30)
            assert got["status"] == 200  # the held request was not lost
            assert wait_until(lambda: c.get("/health").status_code == 200, timeout=5)
            assert c.post("/v1/audio/speech", json=SPEECH).status_code == 200
    finally:
        release.set()

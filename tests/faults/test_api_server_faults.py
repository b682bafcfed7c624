"""An API server killed (-9) under load: the requests on the other API server run to their end, the core frees
what the dead one held, and the launcher brings it back (its requests are lost with its connections: a client of
a dead process can only see its connection close)."""

from __future__ import annotations

import os
import re
import signal
import threading

import httpx

from tests.prom_util import metric
from tests.server.conftest import wait_until
from tests.server.multiproc_helpers import ServeProcess

SPEECH = {"model": "tts-1", "input": "Hello there.", "voice": "alloy", "response_format": "pcm", "seed": 5}
STREAM = {**SPEECH, "input": "long " * 20, "min_new_tokens": 400, "max_new_tokens": 400}


def _running(client: httpx.Client) -> float:
    return metric(client.get("/metrics").text, "ttsserve_num_requests_running")


def test_a_killed_api_server_under_load_loses_only_its_own_requests(tmp_path):
    srv = ServeProcess(tmp_path, "--max-new-tokens", "3000", "--voices-db", str(tmp_path / "v.db"))
    try:
        srv.wait_ready()
        clients = srv.pinned_clients()
        results: dict[str, list] = {"0": [], "1": []}
        started = threading.Semaphore(0)

        def stream(index: str) -> None:
            try:
                with clients[index].stream("POST", "/v1/audio/speech", json=STREAM) as r:
                    n = 0
                    for chunk in r.iter_bytes():
                        n += len(chunk)
                        started.release()
                results[index].append(n)
            except httpx.HTTPError as e:
                results[index].append(e)

        # one connection per API server, so the streams are one after another on each
        threads = [threading.Thread(target=stream, args=(i,)) for i in ("0", "1")]
        for t in threads:
            t.start()
        for _ in threads:
            assert started.acquire(timeout=60)
        os.kill(srv.pid_of("API server 1"), signal.SIGKILL)
        for t in threads:
            t.join(60)
        assert isinstance(results["0"][0], int) and results["0"][0] > 380 * 512 * 2, results  # ran to its end
        assert isinstance(results["1"][0], httpx.TransportError), results
        assert wait_until(lambda: _running(clients["0"]) == 0, timeout=10)  # the core freed the dead one's request
        assert wait_until(lambda: len(re.findall(r"API server 1: pid", srv.log())) == 2, timeout=30), srv.log()
        clients["1"].close()
        srv.wait_ready(60)
        clients.update(srv.pinned_clients())
        assert clients["1"].post("/v1/audio/speech", json=SPEECH).status_code == 200
        for c in clients.values():
            c.close()
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]

"""The serve bench against a minimal OpenAI-speech stand-in whose timing and failures the test controls:
checks byte -> sample accounting, underrun detection, error counts, /metrics scraping, QPS mode, reports."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from tests.bench.live_server import LiveServer
from ttsserve.bench.report import build_report, write_report
from ttsserve.bench.server_metrics import histogram_quantile, parse_prometheus
from ttsserve.bench.serving import ServeSpec, check_loopback, run_serving

CHUNK = 2400  # samples per chunk: 0.1 s at 24 kHz


def standin_app() -> FastAPI:
    """Request i (seed = i with --seed 0) streams 3 + i % 3 chunks of 0.1 s, 10 ms apart; seed 2 pauses
    0.6 s before its last chunk (an underrun of ~0.2 s); seed 3 answers 429."""
    app = FastAPI()
    app.state.in_flight = 0

    @app.post("/v1/audio/speech")
    async def speech(request: Request):
        body = await request.json()
        assert body["response_format"] == "pcm" and body["stream_format"] == "audio"
        seed = body["seed"]
        if seed == 3:
            return JSONResponse({"error": {"message": "busy", "type": "rate_limit"}}, status_code=429)
        n = 3 + seed % 3

        async def gen():
            app.state.in_flight += 1
            try:
                for k in range(n):
                    await asyncio.sleep(0.6 if (seed == 2 and k == n - 1) else 0.01)
                    # odd split of a chunk: byte accounting must not depend on sample alignment
                    data = b"\x01\x00" * CHUNK
                    yield data[:1001]
                    yield data[1001:]
            finally:
                app.state.in_flight -= 1

        return StreamingResponse(gen(), media_type="audio/pcm")

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(
            "# HELP x\nprocess_resident_memory_bytes 1.5e8\n"
            f"ttsserve_kv_cache_usage_ratio {0.1 * app.state.in_flight}\n"
            "ttsserve_num_preemptions_total 0\n"
        )

    return app


def expected_samples(seed: int) -> int:
    return (3 + seed % 3) * CHUNK


def test_concurrency_point_accounting(tmp_path) -> None:
    with LiveServer(standin_app()) as srv:
        spec = ServeSpec(url=srv.url, concurrency=[2], num_requests=6, duration=30, max_new_tokens=None)
        (res,) = run_serving(spec, progress=False)
    s = res.summary()
    assert s["num_requests"] == 6 and s["errors"] == {"429": 1} and s["num_ok"] == 5
    by_seed = {int(r.request_id.split("-")[1]): r for r in res.requests}
    for seed, r in by_seed.items():
        if seed != 3:
            assert r.num_samples == expected_samples(seed), seed
            assert 0 < r.ttfa_s < r.latency_s
    assert s["audio_seconds"] == pytest.approx(sum(expected_samples(i) for i in (0, 1, 2, 4, 5)) / 24000)
    # only seed 2 stalls: its 5th chunk comes 0.6 s after the first 4 (0.4 s of audio)
    assert [i for i, r in sorted(by_seed.items()) if r.underruns] == [2]
    assert 0.1 < by_seed[2].stall_s < 0.5
    assert s["underrun_streams"] == 1
    assert s["peak_memory_bytes"] == 150_000_000 and s["memory_kind"] == "server_metrics"
    assert s["kv_cache_usage_peak"] is not None and s["kv_cache_usage_peak"] <= 0.2 + 1e-9  # 2 clients at most
    report = build_report("serve", [res], {"spec": {}}, {"command": "t"})
    out = write_report(report, [res], tmp_path)
    data = json.loads((out / "report.json").read_text())
    assert data["results"][0]["summary"]["errors"] == {"429": 1}
    assert "concurrency 2" in (out / "report.md").read_text()
    assert (out / "ttfa_cdf.png").exists()


def test_qps_point_is_bounded_by_duration() -> None:
    import time

    with LiveServer(standin_app()) as srv:
        spec = ServeSpec(url=srv.url, qps=[20.0], num_requests=1000, duration=1.0, max_new_tokens=None)
        t0 = time.time()
        (res,) = run_serving(spec, progress=False)
        t1 = time.time()
    assert res.load_kind == "qps" and 5 <= len(res.requests) <= 60
    assert res.wall_s < 10
    sent = sorted(r.sent_at for r in res.requests)  # wall-clock send times, to line up with server logs
    assert t0 <= sent[0] and sent[-1] <= t1 and sent[-1] - sent[0] <= 1.0 + 0.5


def test_the_open_loop_sends_every_scheduled_arrival_however_slow_a_send_is(monkeypatch) -> None:
    """Poisson arrivals are sent at their drawn times: a send that blocks the loop for a while (here 2 ms, a
    fifth of the mean gap) delays the next sends but does not thin them, so the offered rate is the asked one.
    The count is the number of the seeded draws that fall inside the duration."""
    import random
    import time

    from ttsserve.bench import serving

    qps, duration, seed = 100.0, 0.5, 7
    sends = []

    async def slow_send(client, spec, sentence, index):
        sends.append(time.perf_counter())
        time.sleep(0.002)  # the loop's own work for one send (building it, the first bytes)
        return index

    monkeypatch.setattr(serving, "one_request", slow_send)
    spec = ServeSpec(url="http://127.0.0.1:1", qps=[qps], duration=duration)
    items = [(i, None) for i in range(1000)]
    got = asyncio.run(serving._open_loop(serving._Clients(object), spec, items, qps, seed, lambda: None))
    rng, at, want = random.Random(seed), 0.0, 0
    while at < duration:
        want, at = want + 1, at + rng.expovariate(qps)
    assert got == list(range(want))
    assert sends[-1] - sends[0] < duration + 0.1  # caught up, not stretched by 2 ms a send


def test_non_loopback_urls_are_refused() -> None:
    for ok in ("http://127.0.0.1:8000", "http://localhost:1", "http://[::1]:80", "http://127.3.4.5"):
        check_loopback(ok, False)
    for bad in ("http://10.0.0.1:8000", "https://example.com", "http://0.0.0.0:80"):
        with pytest.raises(ValueError, match="--allow-remote"):
            check_loopback(bad, False)
        check_loopback(bad, True)
    with pytest.raises(ValueError, match="url must be"):
        ServeSpec(url="ftp://127.0.0.1", concurrency=[1])
    with pytest.raises(ValueError, match="concurrency"):
        ServeSpec(url="http://127.0.0.1")


def test_parse_prometheus() -> None:
    m = parse_prometheus('# TYPE a gauge\na 1\nb{x="1 2"} 2.5e3\nbroken line here\n')
    assert m == {"a": 1.0, 'b{x="1 2"}': 2500.0}


def test_client_processes_split_the_load_and_keep_request_ids() -> None:
    from ttsserve.bench.client_procs import spread

    items = list(range(10))
    assert spread("concurrency", 5, items, 2) == [(3.0, [0, 2, 4, 6, 8]), (2.0, [1, 3, 5, 7, 9])]
    assert [s for s, _ in spread("concurrency", 2, items, 4)] == [1.0, 1.0]  # no process without a client
    assert spread("qps", 4.0, items[:1], 2) == [(2.0, [0])]  # a process without texts is not started
    with LiveServer(standin_app()) as srv:
        spec = ServeSpec(url=srv.url, concurrency=[3], num_requests=9, duration=30, max_new_tokens=None, client_procs=2)
        (res,) = run_serving(spec, progress=False)
    s = res.summary()
    assert sorted(int(r.request_id.split("-")[1]) for r in res.requests) == list(range(9))
    assert s["errors"] == {"429": 1} and s["num_ok"] == 8
    for r in res.requests:  # the same seeds, so the same stand-in answers as one process gets
        seed = int(r.request_id.split("-")[1])
        if seed != 3:
            assert r.num_samples == expected_samples(seed), seed
    assert len(s["client_cpu"]) == 2 and all(0 <= c < 2 for c in s["client_cpu"])
    assert len(s["client_stall_s"]) == 2 and all(0 <= x < 0.2 for x in s["client_stall_s"])
    assert 0 < res.wall_s < 30
    with pytest.raises(ValueError, match="client_procs"):
        ServeSpec(url=srv.url, concurrency=[1], client_procs=0)


def test_auto_client_procs(monkeypatch):
    from ttsserve.bench.serving import auto_client_procs

    monkeypatch.setattr("os.cpu_count", lambda: 16)
    assert [auto_client_procs("concurrency", c) for c in (1, 32, 33, 128, 256, 1024)] == [1, 1, 2, 4, 8, 8]
    assert [auto_client_procs("qps", q) for q in (5.0, 50.0, 51.0, 400.0)] == [1, 1, 2, 8]
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert auto_client_procs("concurrency", 128) == 1  # a 2-core machine keeps one process


def test_histogram_quantile_interpolates_within_a_bucket() -> None:
    buckets = [(0.1, 10.0), (0.2, 60.0), (0.3, 100.0), (float("inf"), 100.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.18)  # rank 50: 40 of the 50 in (0.1, 0.2]
    assert histogram_quantile(0.05, buckets) == pytest.approx(0.05)  # from 0 in the first bucket
    assert histogram_quantile(0.99, buckets) == pytest.approx(0.2975)
    assert histogram_quantile(0.99, [(0.1, 0.0), (float("inf"), 4.0)]) == 0.1  # past every bound: the last one
    assert histogram_quantile(0.5, [(0.1, 0.0), (float("inf"), 0.0)]) is None and histogram_quantile(0.5, []) is None


def test_per_core_series_fold_into_server_totals() -> None:
    from ttsserve.bench.server_metrics import fold_cores, server_figures

    def scrape(steps0: float, steps1: float, wait1: float) -> dict:
        return parse_prometheus(
            f'ttsserve_engine_steps_total{{core="0"}} {steps0}\nttsserve_engine_steps_total{{core="1"}} {steps1}\n'
            f'ttsserve_num_requests_waiting{{core="0"}} 0\nttsserve_num_requests_waiting{{core="1"}} {wait1}\n'
            f'ttsserve_kv_cache_usage_ratio{{core="0"}} 0.2\nttsserve_kv_cache_usage_ratio{{core="1"}} 0.5\n'
            f'vllm:num_requests_waiting{{core="1",model_name="chattts"}} {wait1}\n'
        )

    folded, cores = fold_cores(scrape(10, 30, 2))
    assert folded["ttsserve_engine_steps_total"] == 40 and folded["ttsserve_kv_cache_usage_ratio"] == 0.5
    assert (
        folded['vllm:num_requests_waiting{model_name="chattts"}'] == 2
        and cores["1"]["ttsserve_engine_steps_total"] == 30
    )
    figs = server_figures([scrape(15, 35, 4), scrape(20, 40, 0)], scrape(10, 30, 0), scrape(20, 50, 0), 2.0)
    assert figs["server_steps_per_s"] == 15.0
    assert figs["server_cores"] == {
        "0": {"steps_per_s": 5.0, "waiting_mean": 0.0},
        "1": {"steps_per_s": 10.0, "waiting_mean": 2.0},
    }


def test_a_stalled_client_loop_is_measured_and_reported(monkeypatch, tmp_path) -> None:
    """A load-generator loop held 0.4 s (here: a blocking sleep while a byte count runs) shows in the summary
    and in the report's client column: that delay is the client's, not the server's."""
    import time

    from ttsserve.bench import serving

    counter = serving._sample_counter
    held = []

    def slow_counter(fmt):
        count = counter(fmt)

        def feed(chunk: bytes) -> int:
            if not held:
                held.append(1)
                time.sleep(0.4)
            return count(chunk)

        return feed

    monkeypatch.setattr(serving, "_sample_counter", slow_counter)
    with LiveServer(standin_app()) as srv:
        spec = ServeSpec(url=srv.url, concurrency=[2], num_requests=4, duration=30, max_new_tokens=None, client_procs=1)
        results = run_serving(spec, progress=False)
    (stall,) = results[0].summary()["client_stall_s"]
    assert 0.3 < stall < 2
    out = write_report(build_report("serve", results, {"spec": {}}, {"command": "t"}), results, tmp_path, plots=False)
    assert "stalled 0." in (out / "report.md").read_text()


def test_ttfa_after_the_warmup_leaves_out_the_requests_sent_before_it(tmp_path) -> None:
    """--warmup-s: the summary and the report add the TTFA of the requests sent after the warm-up; every other
    figure still counts every request."""
    from ttsserve.bench.results import RequestRecord, RunResult

    # a first wave (sent at 0-0.5 s) slow to start, a steady second one
    recs = [
        RequestRecord(f"serve-{i}", num_samples=24000, latency_s=1.0, ttfa_s=0.9, sent_at=100 + i / 10)
        for i in range(5)
    ]
    recs += [
        RequestRecord(f"serve-{i}", num_samples=24000, latency_s=1.0, ttfa_s=0.2, sent_at=102 + i / 10)
        for i in range(5, 25)
    ]
    res = RunResult("server", "serve", "concurrency", 5.0, 5.0, recs, extra={"warmup_s": 1.0})
    s = res.summary()
    assert s["num_after_warmup"] == 20 and s["ttfa_s_after_warmup"]["p99"] == pytest.approx(0.2)
    assert s["ttfa_s"]["p99"] == pytest.approx(0.9) and s["num_ok"] == 25
    md = write_report(build_report("serve", [res], {"spec": {}}, {"command": "t"}), [res], tmp_path) / "report.md"
    assert "0.20 / 0.20 s over the 20 requests sent after the first 1 s" in md.read_text()
    assert "ttfa_s_after_warmup" not in RunResult("server", "serve", "concurrency", 5.0, 5.0, recs).summary()


def test_a_live_point_with_a_warmup_reports_the_requests_after_it() -> None:
    with LiveServer(standin_app()) as srv:
        spec = ServeSpec(url=srv.url, qps=[20.0], num_requests=1000, duration=1.5, max_new_tokens=None, warmup_s=0.5)
        (res,) = run_serving(spec, progress=False)
    s = res.summary()
    t0 = min(r.sent_at for r in res.requests)
    after = [r for r in res.requests if r.status == "ok" and r.sent_at - t0 >= 0.5]
    assert 0 < s["num_after_warmup"] == len(after) < s["num_ok"]
    with pytest.raises(ValueError, match="warmup_s"):
        ServeSpec(url=srv.url, concurrency=[1], duration=2.0, warmup_s=2.0)


def test_each_stream_in_flight_has_a_client_of_its_own_reused_by_the_next_request(monkeypatch) -> None:
    """One client (one connection) per request in flight, handed to the next request, all closed at the end: a
    shared client's pool scanned every connection for every queued request (benchmarks/client_cost.py)."""
    from ttsserve.bench import serving
    from ttsserve.bench.corpus import select_texts

    made = []
    new = serving._Clients._new
    monkeypatch.setattr(serving._Clients, "_new", lambda self: made.append(new(self)) or made[-1])
    with LiveServer(standin_app()) as srv:
        spec = ServeSpec(url=srv.url, concurrency=[3], num_requests=9, duration=30, max_new_tokens=None)
        items = list(enumerate(select_texts(9, seed=0)))
        records, _, _ = asyncio.run(serving.drive_load(spec, "concurrency", 3.0, items, 0))
    assert len(records) == 9 and sum(r.status == "ok" for r in records) == 8  # seed 3 answers 429
    assert len(made) == 3 and all(c.is_closed for c in made)

"""The load generator's own cost: `bench serve`'s closed loop (one client process) against a stand-in server in
another process that streams 8 chunks of 3,328 samples 50 ms apart a request. Prints, per round, the client's
CPU a request, the longest its event loop was late (every request in flight waits that long, and TTFA counts it)
and the TTFA percentiles it saw against a server whose own first chunk leaves after 50 ms.

    python3 benchmarks/client_cost.py [--concurrency 64] [--rounds 3]
"""

import argparse
import asyncio
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def standin():
    from fastapi import FastAPI, Request
    from fastapi.responses import PlainTextResponse, StreamingResponse

    app = FastAPI()

    @app.post("/v1/audio/speech")
    async def speech(request: Request):
        await request.json()

        async def chunks():
            for _ in range(8):
                await asyncio.sleep(0.05)
                yield b"\x01\x00" * 3328

        return StreamingResponse(chunks(), media_type="audio/pcm")

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse("")

    return app


def main() -> None:
    import httpx

    from ttsserve.bench.corpus import select_texts
    from ttsserve.bench.serving import ServeSpec, drive_load

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--port", type=int, default=8765)
    a = ap.parse_args()
    code = f"import uvicorn, sys; sys.path.insert(0, {str(REPO)!r}); from benchmarks.client_cost import standin; "
    code += f"uvicorn.run(standin(), port={a.port}, log_level='warning')"
    server = subprocess.Popen([sys.executable, "-c", code])
    url = f"http://127.0.0.1:{a.port}"
    try:
        for _ in range(100):
            try:
                httpx.get(f"{url}/metrics")
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        n = 6 * a.concurrency
        spec = ServeSpec(url=url, concurrency=[a.concurrency], num_requests=n, duration=60, max_new_tokens=None)
        items = list(enumerate(select_texts(n, seed=0)))
        for _ in range(a.rounds):
            cpu0 = time.process_time()
            records, _, stall = asyncio.run(drive_load(spec, "concurrency", float(a.concurrency), items, 0))
            ok = sorted(r.ttfa_s for r in records if r.status == "ok")
            if not ok:
                sys.exit(f"no request succeeded: {sorted({r.status for r in records})}")
            print(
                f"{a.concurrency} streams: {len(ok)} ok, client CPU {1e3 * (time.process_time() - cpu0) / len(ok):.2f} "
                f"ms a request, event loop late by {stall:.3f} s at most, TTFA p50 {ok[len(ok) // 2]:.3f} p99 "
                f"{ok[int(0.99 * len(ok))]:.3f} s"
            )
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()

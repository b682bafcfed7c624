"""What sending a step's audio to the API servers costs the engine core's thread: one CoreOutputs a server,
each with `--outputs` chunks of `--samples` float32 samples (default: 12 servers x 45 chunks of 6.5 frames, ~0.6 MB
a message, a 512-stream step), encoded and sent over an ipc ROUTER/DEALER pair as EngineCoreProc._flush does,
against the way it did before: a fresh bytes a message, sent zero-copy. A thread on the receiving side drains.

Usage: python3 benchmarks/core_send_cost.py [--servers 12] [--outputs 45] [--samples 3328] [--steps 60] [--rounds 3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgspec
import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ttsserve.engine.core.messages import CoreOutputs, RequestOutput, encoder  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", type=int, default=12)
    ap.add_argument("--outputs", type=int, default=45)
    ap.add_argument("--samples", type=int, default=3328)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    msgs = [
        CoreOutputs(
            outputs=[
                RequestOutput(
                    f"req-{i:08d}",
                    rng.standard_normal(a.samples).astype(np.float32).tobytes(),
                    False,
                    7,
                    None,
                    [],
                    None,
                    [],
                )  # fmt: skip
                for i in range(a.outputs)
            ]
        )
        for _ in range(a.servers)
    ]
    address = f"ipc://{tempfile.mkdtemp()}/send.sock"
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(address)
    idents = [f"api{i}".encode() for i in range(a.servers)]
    dealers = []
    for ident in idents:
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.IDENTITY, ident)
        d.connect(address)
        d.send(b"")
        dealers.append(d)
    for _ in idents:
        router.recv_multipart()
    poller = zmq.Poller()
    for d in dealers:
        poller.register(d, zmq.POLLIN)
    done = threading.Event()

    def drain() -> None:
        while not done.is_set():
            for sock, _ in poller.poll(100):
                sock.recv(copy=False)

    threading.Thread(target=drain, daemon=True).start()
    out = bytearray()

    def fresh_zero_copy() -> None:
        for ident, m in zip(idents, msgs):
            p = encoder.encode(m)
            router.send_multipart([ident, p], copy=len(p) < 65536)

    def reused_copied() -> None:
        for ident, m in zip(idents, msgs):
            encoder.encode_into(m, out)
            router.send_multipart([ident, out], copy=True)

    size = len(msgspec.msgpack.encode(msgs[0]))
    print(f"{a.servers} messages of {size / 1e6:.2f} MB a step")
    for _ in range(a.rounds):
        for fn in (fresh_zero_copy, reused_copied):
            t0 = time.perf_counter()
            for _ in range(a.steps):
                fn()
            print(f"  {fn.__name__:16s} {(time.perf_counter() - t0) / a.steps * 1e3:6.2f} ms a step", flush=True)
    done.set()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

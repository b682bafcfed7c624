"""The engine core's flush encodes every API server's CoreOutputs into one buffer it reuses, so each send must
copy: two servers flushed back to back, each with ~1 MB of audio that only it asked for, each receive their own
bytes, every time (a zero-copy send of the reused buffer hands the first server the second's audio)."""

from __future__ import annotations

import numpy as np
import zmq

from ttsserve.config import EngineConfig
from ttsserve.engine.core.messages import RequestOutput, core_decoder
from ttsserve.engine.core.proc import EngineCoreProc, _Batch
from ttsserve.engine.engine import Engine

TINY = dict(load_format="dummy", dummy_size="tiny", dtype="float32", device="cpu", kv_cache_memory=16 << 20)


def test_each_server_gets_its_own_outputs(tmp_path) -> None:
    core = EngineCoreProc(Engine(EngineConfig(**TINY)), f"ipc://{tmp_path}/core.sock", drain_timeout_s=1)
    servers = {}
    try:
        for name in (b"api0", b"api1"):
            s = core.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.IDENTITY, name)
            s.setsockopt(zmq.RCVTIMEO, 5000)
            s.connect(f"ipc://{tmp_path}/core.sock")
            servers[name] = s
            s.send(b"")  # the ROUTER (ROUTER_MANDATORY) knows a server once it heard from it
            assert core.sock.recv_multipart()[0] == name
        rng = np.random.default_rng(0)
        for _ in range(20):
            sent = {}
            for i, name in enumerate(servers):
                audio = rng.standard_normal(1 << 18).astype(np.float32)  # 1 MiB
                sent[name] = audio
                out = RequestOutput(f"r{i}", memoryview(audio).cast("B"), False, 1, None, [], None, [])
                core.batches[name] = _Batch(outputs=[out])
            core._flush()
            for name, s in servers.items():
                msg = core_decoder.decode(s.recv())
                assert [o.request_id for o in msg.outputs] == [f"r{list(servers).index(name)}"]
                np.testing.assert_array_equal(np.frombuffer(msg.outputs[0].samples, np.float32), sent[name])
    finally:
        for s in servers.values():
            s.close(linger=0)
        core._close()

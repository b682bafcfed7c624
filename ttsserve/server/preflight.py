"""What `ttsserve serve` checks before the slow model load.

A real-size model takes seconds to minutes to load (more on a GPU, which also profiles and captures graphs);
a setting that cannot work must not cost that wait and end in a traceback. Everything here reads no weights
and raises ValueError with a one-line message naming the setting; `run_serve` prints it and exits 2.
"""

from __future__ import annotations

import socket
import sys

from ttsserve.config import EngineConfig, GPTConfig


def check_engine_config(cfg: EngineConfig) -> None:
    """ValueError naming the first setting of `cfg` that cannot work on this machine: the checkpoint (found
    and complete; `--model` a real folder or hub id), the device (CUDA present, index in range), an fp8 KV
    cache off CUDA, $TTSSERVE_CPU_COMPILE, $TTSSERVE_DECODE_OPS, $OMP_NUM_THREADS on the CPU, and a
    --kv-cache-memory too small for two blocks. EngineConfig itself has already checked each value's range."""
    from ttsserve.config import compile_level, decode_ops_mode
    from ttsserve.layers.quant.kv_fp8 import check_kv_cache_dtype
    from ttsserve.model.chattts import locate_checkpoint, resolve_device, resolve_dtype

    device = resolve_device(cfg.device)
    check_kv_cache_dtype(cfg.kv_cache_dtype, device)
    compile_level()
    decode_ops_mode()
    if device.type == "cpu":
        from ttsserve.runner.cpu_threads import plan_cpu_threads

        plan_cpu_threads(cfg.cpu_threads)
    root = locate_checkpoint(cfg)
    if cfg.kv_cache_memory is not None:
        from ttsserve.runner.kv_cache import plan_kv_cache

        plan_kv_cache(
            _gpt_config(cfg, root),
            resolve_dtype(cfg.dtype, device),
            cfg.block_size,
            cfg.kv_cache_memory,
            0,
            kv_cache_dtype=cfg.kv_cache_dtype,
        )


def check_voices_db(spec: str) -> None:
    """ValueError when --voices-db is a PostgreSQL URL the server cannot use: psycopg missing, the server
    unreachable, the login or the database refused, no right to create the table. The message is one line
    with the password masked. Opening the store once also creates its table, so API servers that start
    together find it there. A SQLite path is not checked here (its folder is made when the store opens)."""
    from ttsserve.server.voice_store import is_postgres_url, open_voice_store
    from ttsserve.server.voices import VoiceStoreError

    if not is_postgres_url(spec):
        return
    try:
        open_voice_store(spec).close()
    except VoiceStoreError as e:
        raise ValueError(f"--voices-db {e.store}: {e.reason}") from None


def _gpt_config(cfg: EngineConfig, root) -> GPTConfig:
    """The GPT sizes the load will see: the checkpoint's config.json, or the dummy size's."""
    import json

    if root is None:
        from ttsserve.model.dummy import SIZES, gpt_config_json

        return GPTConfig.from_hf_json(gpt_config_json(SIZES[cfg.dummy_size]))
    path = root / "asset" / "gpt" / "config.json"
    try:
        return GPTConfig.from_hf_json(json.loads(path.read_text()))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON file ({e})") from None


# Linux spreads a port's new connections over the listening sockets of one SO_REUSEPORT group by a hash of
# the connection's addresses; elsewhere (macOS, Windows) the option does not balance, so all share one socket.
REUSE_PORT_BALANCES = sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")


def bind_socket(host: str, port: int, reuse_port: bool = False, join: bool = False) -> socket.socket:
    """A socket bound to host:port, not yet listening (uvicorn listens once the engine is up; until then a
    client is refused, not left hanging). Held through the model load, so a process binding it meanwhile
    without SO_REUSEADDR is refused (Linux lets two SO_REUSEADDR sockets bind while neither listens, so a
    second uvicorn started during the load would win the port: rare, and then listen() fails after the
    load). The address family and SO_REUSEADDR follow uvicorn's own binding. ValueError if it cannot bind
    (port in use, no such address, a privileged port).

    reuse_port: the first socket of an SO_REUSEPORT group (one listening socket per API server). The port
    is first probed with a plain bind, so a group some other server of this user already holds is an error,
    not a silent share of its traffic. join: another socket of the group this process already holds."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    shown = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
    if reuse_port and not join:
        bind_socket(host, port).close()
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port or join:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {shown}: {e.strerror or e} (--host / --port)") from None
    return sock

"""`ttsserve serve`: every EngineConfig knob and every server setting as a flag and a TTSSERVE_* env var.

Precedence: command-line flag > environment variable > built-in default. Engine flags are generated from
EngineConfig's fields (`--block-size` <-> TTSSERVE_BLOCK_SIZE <-> EngineConfig.block_size; booleans get
`--x/--no-x`), so a knob added to EngineConfig is a flag without touching this file.

    ttsserve serve --model ./asset --port 8000 --api-key k1,k2 --requests-per-minute 60
    python -m ttsserve.entrypoints.serve --load-format dummy --dummy-size tiny --device cpu
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import sys

from ttsserve.config import EngineConfig
from ttsserve.server.preflight import REUSE_PORT_BALANCES, bind_socket, check_engine_config

logger = logging.getLogger("ttsserve.server")
ENV_PREFIX = "TTSSERVE_"

_ENGINE_HELP = {
    "model": "checkpoint folder or hub id (default: $TTSSERVE_MODEL, ./asset, the hub cache)",
    "load_format": "auto | safetensors | dummy (random weights)",
    "dummy_size": "real | tiny: size of random weights for --load-format dummy",
    "device": "auto | cpu | cuda | cuda:N",
    "dtype": "auto | float32 | bfloat16 | float16",
    "quantization": "int8 | awq-int4 (weight-only; a quantized checkpoint from `ttsserve quantize` is detected)",
    "kv_cache_dtype": "auto | fp8 (e4m3 KV cache with per-token-head scales; CUDA only)",
    "lookahead_frames": "right context of streamed windows; unset = exact (stitched stream == one-shot decode)",
    "first_chunk_frames": "frames in the first streamed audio chunk (later chunks double up to max_chunk_frames)",
    "block_size": "KV cache block size in frames (8, 16, 32, 64, 128)",
    "gpu_memory_utilization": "fraction of GPU memory for weights + activations + KV cache",
    "kv_cache_memory": "bytes for the KV pool (suffixes K/M/G/KiB/MiB/GiB accepted)",
    "swap_space": "GiB of host memory for swapped-out KV blocks",
    "max_num_seqs": "most requests in one batch",
    "max_num_batched_tokens": "most positions computed in one step",
    "enable_chunked_prefill": "split long prompts across steps",
    "preemption_mode": "auto | recompute | swap",
    "max_queue_len": "most requests in the engine (queued + running); also the server's in-flight bound",
    "target_step_latency_ms": "dynamic batching goal; 0 disables the controller",
    "async_scheduling": "schedule and queue step n+1 while step n runs on the GPU (default: on with CUDA)",
    "num_scheduler_steps": "decode steps per schedule: a stream's next k frames run back to back on the device, "
                           "host bookkeeping once per k (multi-step scheduling; same codes as 1)",
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'4GiB', '512M', '1.5g', '1073741824' -> bytes (K/M/G/T are powers of 1024)."""
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"not a size: {text!r} (use e.g. 4GiB, 512M or a byte count)")
    return int(float(m.group(1)) * 1024 ** " kmgt".index((m.group(2) or " ").lower()))


def parse_bool(text: str) -> bool:
    v = str(text).strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _converter(name: str, annotation: str):
    """A str -> value function for a field, from its (string) annotation."""
    if name == "kv_cache_memory":
        return parse_size
    base = annotation.replace("| None", "").replace("None |", "").strip()
    return {"bool": parse_bool, "int": int, "float": float}.get(base, str)


def _engine_fields() -> list[tuple[str, object, str]]:
    return [(f.name, f.default, str(f.type)) for f in dataclasses.fields(EngineConfig)]


# (dest, flag, converter, default, help); env var = TTSSERVE_<DEST upper>
_SERVER_FLAGS: list[tuple[str, str, object, object, str]] = [
    ("host", "--host", str, "127.0.0.1", "address to bind (0.0.0.0 for all interfaces)"),
    ("port", "--port", int, 8000, "TCP port"),
    ("requests_per_minute", "--requests-per-minute", int, 0, "per API key (or client address); 0 = no limit"),
    ("chars_per_minute", "--chars-per-minute", int, 0, "input characters per minute per key; 0 = no limit"),
    ("max_in_flight", "--max-in-flight", int, None, "syntheses admitted at once, more get 503 "
                                                    "(default: --max-queue-len)"),
    ("max_input_chars", "--max-input-chars", int, 4096, "longer input gets 413"),
    ("max_body_bytes", "--max-body-bytes", parse_size, 1 << 20, "JSON bodies over this get 413"),
    ("max_upload_bytes", "--max-upload-bytes", parse_size, 25 << 20, "voice uploads over this get 413"),
    ("voices_db", "--voices-db", str, None, "SQLite file of named voices "
                                            "(default: ~/.local/share/ttsserve/voices.db; ':memory:' = none)"),
    ("max_new_tokens", "--max-new-tokens", int, 2048, "server-wide cap on frames per text segment"),
    ("drain_timeout_s", "--drain-timeout", float, 30.0, "seconds to let streams finish on shutdown"),
    ("log_level", "--log-level", str, "info", "debug | info | warning | error"),
]


def add_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    eng = parser.add_argument_group("engine (EngineConfig; each flag also reads TTSSERVE_<NAME>)")
    for name, default, annotation in _engine_fields():
        flag = "--" + name.replace("_", "-")
        env = ENV_PREFIX + name.upper()
        helptext = f"{_ENGINE_HELP.get(name, name.replace('_', ' '))} [env {env}; default {default!r}]"
        if _converter(name, annotation) is parse_bool:
            eng.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=helptext)
        else:
            eng.add_argument(flag, dest=name, default=None, metavar=name.upper(), help=helptext)
    srv = parser.add_argument_group("server (each flag also reads TTSSERVE_<NAME>)")
    for dest, flag, _conv, default, helptext in _SERVER_FLAGS:
        srv.add_argument(flag, dest=dest, default=None,
                         help=f"{helptext} [env {ENV_PREFIX + dest.upper()}; default {default!r}]")
    srv.add_argument("--api-key", dest="api_key", action="append", default=None,
                     help="accepted Bearer key; repeat or comma-separate for several; a blank one is refused "
                          "[env TTSSERVE_API_KEY]")
    srv.add_argument("--served-model-name", dest="served_model_name", action="append", default=None,
                     help="accepted `model` names (repeatable; default: the model's name + tts-1, tts-1-hd, "
                          "gpt-4o-mini-tts) [env TTSSERVE_SERVED_MODEL_NAME, comma list]")
    return parser


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Mount `serve` on a subparsers object (ttsserve/entrypoints/cli.py); the parser's `func` is run_serve."""
    p = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_serve_arguments(p)
    from ttsserve.entrypoints.data_parallel import add_data_parallel_args

    add_data_parallel_args(p)
    from ttsserve.entrypoints.api_servers import add_api_server_args

    add_api_server_args(p)
    p.set_defaults(func=run_serve)
    return p


def _value(args: argparse.Namespace, dest: str, conv, env: dict[str, str]):
    """The flag's value if given, else the env var's, else None. ValueError names the flag or variable."""
    raw = getattr(args, dest, None)
    source = "--" + dest.replace("_", "-")
    if raw is None:
        raw = env.get(ENV_PREFIX + dest.upper())
        source = ENV_PREFIX + dest.upper()
        if raw is None or raw == "":
            return None
    if isinstance(raw, bool):
        return raw
    try:
        return conv(raw)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def _list_value(args: argparse.Namespace, dest: str, env_name: str, env: dict[str, str]) -> tuple[str, ...]:
    items = getattr(args, dest, None)
    if items is None:
        items = [env.get(env_name, "")]
    return tuple(x.strip() for item in items for x in item.split(",") if x.strip())


def _api_keys(args: argparse.Namespace, env: dict[str, str]) -> tuple[str, ...]:
    """--api-key values (each may be a comma list), else $TTSSERVE_API_KEY; () when neither is given.

    A blank key (`--api-key ""`, `TTSSERVE_API_KEY=""`, the empty item of "k1,") is a ValueError: an
    operator who passes a key means to turn authentication on, and a key lost to an unset shell variable
    must not leave the server open (or be silently dropped from the list)."""
    items, source = getattr(args, "api_key", None), "--api-key"
    if items is None:
        raw = env.get(ENV_PREFIX + "API_KEY")
        if raw is None:
            return ()
        items, source = [raw], ENV_PREFIX + "API_KEY"
    keys = [x.strip() for item in items for x in item.split(",")]
    if not all(keys):  # the message never echoes keys: they are secrets, and stderr ends up in logs
        blank = ", ".join(str(i + 1) for i, k in enumerate(keys) if not k)
        raise ValueError(f"{source}: key {blank} of {len(keys)} is blank; every API key must be non-empty "
                         f"(leave {source} out to serve without authentication)")
    return tuple(keys)


def build_configs(args: argparse.Namespace, env: dict[str, str] | None = None):
    """-> (EngineConfig, ServerConfig, host, port, log_level). ValueError for bad values (names the source)."""
    from ttsserve.server.app import ServerConfig

    env = dict(os.environ if env is None else env)
    engine_kw = {}
    for name, _default, annotation in _engine_fields():
        value = _value(args, name, _converter(name, annotation), env)
        if value is not None:
            engine_kw[name] = value
    engine_cfg = EngineConfig(**engine_kw)
    srv = {}
    for dest, _flag, conv, default, _help in _SERVER_FLAGS:
        value = _value(args, dest, conv, env)
        srv[dest] = default if value is None else value
    host, port, log_level = srv.pop("host"), srv.pop("port"), srv.pop("log_level")
    if srv["max_in_flight"] is None:
        srv["max_in_flight"] = engine_cfg.max_queue_len
    if srv["voices_db"] is None:
        srv["voices_db"] = os.path.join(os.path.expanduser("~"), ".local", "share", "ttsserve", "voices.db")
    server_cfg = ServerConfig(
        api_keys=_api_keys(args, env),
        served_model_names=_list_value(args, "served_model_name", ENV_PREFIX + "SERVED_MODEL_NAME", env),
        **srv,
    )
    if not (0 < port < 65536):
        raise ValueError(f"--port must be in 1..65535, got {port}")
    return engine_cfg, server_cfg, host, port, log_level


def _configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)


def _server_cpu_defaults(engine_cfg) -> None:
    """A CPU server compiles its decode attention, then its whole decode step, unless $TTSSERVE_CPU_COMPILE
    says otherwise ("attention": the attention only; "0": nothing): a server lives long, and a minute or two
    of background compilation (once per process, after /ready, served eagerly meanwhile; a C++ compiler is
    needed, else it stays eager) buys a quarter of the step time at 8 streams (BENCHMARKS.md, CPU fast
    path). One-shot `ttsserve say` keeps it off."""
    import torch

    from ttsserve.attention.torch_ref import COMPILE_ENV

    on_cpu = engine_cfg.device == "cpu" or (engine_cfg.device == "auto" and not torch.cuda.is_available())
    if on_cpu and COMPILE_ENV not in os.environ:
        os.environ[COMPILE_ENV] = "1"
        logger.info("the CPU decode step will be compiled with torch.compile in the background (%s=0 turns it "
                    "off, =attention keeps it to the attention)", COMPILE_ENV)


def run_serve(args: argparse.Namespace) -> int:
    """Check the flags and bind the port (fast), load the engine (slow), log how many streams fit, serve until
    SIGINT/SIGTERM, drain, exit. A bad setting is one line on stderr and exit status 2, before the load when
    the weights are not needed to see it."""
    from ttsserve.entrypoints.data_parallel import data_parallel_size, run_data_parallel

    try:
        if data_parallel_size(args) > 1:  # one engine per GPU behind the built-in balancer
            return run_data_parallel(args)
        engine_cfg, server_cfg, host, port, log_level = build_configs(args)
        from ttsserve.attention.torch_ref import compile_level

        compile_level()  # a bad $TTSSERVE_CPU_COMPILE is a config error, reported before the slow load
        from ttsserve.entrypoints.api_servers import api_server_count, run_api_servers

        api_servers = api_server_count(args)
        # Everything that can be checked without the weights, before the slow load: a bad --model, a missing
        # GPU, a taken port. The socket stays bound through the load, so the port cannot be lost meanwhile.
        check_engine_config(engine_cfg)
        sock = bind_socket(host, port, reuse_port=api_servers > 1 and REUSE_PORT_BALANCES)
    except ValueError as e:
        return _config_error(e)
    if api_servers > 0:  # the engine core in its own process, N HTTP/encoding processes (server/multiproc.py)
        return run_api_servers(engine_cfg, server_cfg, host, port, log_level, api_servers, sock=sock)
    import uvicorn

    from ttsserve.engine.async_engine import AsyncEngine
    from ttsserve.server.app import create_app

    _configure_logging(log_level)
    _server_cpu_defaults(engine_cfg)
    logger.info("loading model (%s)", engine_cfg.model or engine_cfg.load_format)
    try:
        engine = AsyncEngine.from_config(engine_cfg)
    except ValueError as e:  # what only the checkpoint's contents reveal (a bad tensor, a quantization mismatch)
        sock.close()
        return _config_error(e)
    app = create_app(engine, server_cfg)  # its lifespan logs engine.memory_report() (how many streams fit)
    from ttsserve.engine.core.heap import freeze_startup_heap

    freeze_startup_heap("server")
    # Our own JSON access log replaces uvicorn's; graceful shutdown waits for streams up to the drain timeout.
    # On SIGTERM uvicorn drains, then re-raises the signal, so the exit status is the conventional 143.
    config = uvicorn.Config(app, log_level=log_level.lower(), access_log=False, lifespan="on",
                            timeout_graceful_shutdown=server_cfg.drain_timeout_s)
    shown = f"[{host}]" if ":" in host else host
    logger.info("serving on http://%s:%d once the engine is up (Ctrl+C to quit)", shown, port)
    uvicorn.Server(config).run(sockets=[sock])  # exits 3 itself if the app fails to start (as uvicorn.run)
    return 0


def _config_error(e: ValueError) -> int:
    print(f"ttsserve serve: error: {e}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ttsserve serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_serve_arguments(parser)
    from ttsserve.entrypoints.api_servers import add_api_server_args

    add_api_server_args(parser)
    return run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

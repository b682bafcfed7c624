"""The server's settings: ServerConfig (the one place their defaults live) and the `serve` flags.

Precedence: command-line flag > environment variable > built-in default. Engine flags are generated from
EngineConfig's fields (engine/args.py: `--block-size` <-> TTSSERVE_BLOCK_SIZE <-> EngineConfig.block_size;
booleans get `--x/--no-x`), server flags from ServerConfig's, so a knob added to either is a flag without
touching this file.

    ttsserve serve --model ./asset --port 8000 --api-key k1,k2 --requests-per-minute 60
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field

from ttsserve.config import EngineConfig
from ttsserve.engine.args import (
    ENV_PREFIX,
    add_engine_args,
    add_model_args,
    engine_kwargs,
    parse_bool,
    parse_size,
    read_value,
)
from ttsserve.server.preflight import check_voices_db

logger = logging.getLogger("ttsserve.server")


def _flag(help_text: str, parse=None, flag: str | None = None, cli_default=dataclasses.MISSING) -> dict:
    """A ServerConfig field's flag: its help, its str -> value parser (default: from the annotation), its name
    when not --<field> and, where `serve` differs from the library, its command-line default."""
    return {"help": help_text, "parse": parse, "flag": flag, "cli_default": cli_default}


def parse_list(text: str) -> tuple[str, ...]:
    """A JSON list (vLLM's form: '["https://a.example", "https://b.example"]') or comma-separated values."""
    text = str(text).strip()
    if text.startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"not a JSON list: {e.msg}") from None
        if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
            raise ValueError("must be a JSON list of strings")
    else:
        items = text.split(",")
    return tuple(x.strip() for x in items if x.strip())


@dataclass
class ServerConfig:
    """HTTP-side settings (the engine's are EngineConfig).

    max_in_flight: syntheses admitted at once (queued in the engine or streaming); more get 503. `serve`
        defaults it to the engine's max_queue_len.
    max_new_tokens: server-wide cap on frames per text segment; a request asking for more gets the cap (its
        finish reason says `length`). 2048 frames = 43.7 s, the reference's default: without a cap one request
        could hold a stream slot for the model's whole context.
    served_model_names: accepted `model` values; empty means the engine's name plus OpenAI's tts names.
    voices_db: where named voices are stored: a SQLite file (`serve` defaults it to
        ~/.local/share/ttsserve/voices-<port>.db, one per server, so two servers a user runs do not share or
        lock one file), ":memory:", or a postgresql:// URL that servers on several machines share.
    request_timeout_s: None = no limit: a long text streams for minutes, and the engine's own bounds
        (max_new_tokens per segment, max_audio_seconds per request) already end every synthesis.
    max_audio_seconds: max_new_tokens bounds one segment only; a 4096-character text has dozens of segments.
    """

    api_keys: tuple[str, ...] = ()
    admin_api_keys: tuple[str, ...] = ()
    auth_docs_and_metrics: bool = field(
        default=False,
        metadata=_flag(
            "require an API key for /docs, /redoc, /openapi.json and /metrics too (default: they are open)",
            parse_bool,
        ),
    )
    requests_per_minute: int = field(
        default=0, metadata=_flag("requests per minute per API key (or client address), more get 429; 0 = no limit")
    )
    chars_per_minute: int = field(
        default=0,
        metadata=_flag("input characters per minute per API key (or client address), more get 429; 0 = no limit"),
    )
    max_input_chars: int = field(
        default=4096, metadata=_flag("characters of input text one request may have; longer gets 413")
    )
    max_body_bytes: int = field(
        default=1 << 20, metadata=_flag("bytes of a JSON request body (K/M/G suffixes); larger gets 413", parse_size)
    )
    max_upload_bytes: int = field(
        default=25 << 20, metadata=_flag("bytes of a voice upload (K/M/G suffixes); larger gets 413", parse_size)
    )
    max_in_flight: int = field(
        default=1024,
        metadata=_flag("syntheses admitted at once, more get 503 (default: --max-queue-len)", cli_default=None),
    )
    voices_db: str = field(
        default=":memory:",
        metadata=_flag(
            "where named voices are stored: a SQLite file (default: ~/.local/share/ttsserve/voices-<port>.db, "
            "one per server port), ':memory:' (kept in memory only), or a PostgreSQL URL "
            "postgresql://user:password@host:port/database that servers on several machines share (needs "
            "psycopg: pip install 'psycopg[binary]'; checked at start)",
            cli_default=None,
        ),
    )
    served_model_names: tuple[str, ...] = ()
    max_new_tokens: int | None = field(
        default=2048,
        metadata=_flag("server-wide cap on audio frames per text segment (a frame is 21.3 ms; 2048 = 43.7 s)"),
    )
    request_timeout_s: float | None = field(
        default=None,
        metadata=_flag(
            "seconds a synthesis may take from admission to its last audio; later it ends: 504 request_timeout "
            "before any audio, a cut stream after (default: no limit)",
            flag="--request-timeout",
        ),
    )
    max_audio_seconds: float | None = field(
        default=600.0,
        metadata=_flag(
            "seconds of audio one request may produce (all its segments); the audio stops there with finish "
            "reason length, and text that would surely run longer gets 400"
        ),
    )
    drain_timeout_s: float = field(
        default=30.0, metadata=_flag("seconds to let streams finish on shutdown", flag="--drain-timeout")
    )
    timeout_keep_alive_s: float = field(
        default=75.0,
        metadata=_flag(
            "seconds an idle keep-alive connection is kept open; keep it above your clients' and proxies' idle "
            "expiry (httpx: 5 s, nginx upstream: 60 s), or a request sent as it closes is reset",
            flag="--timeout-keep-alive",
        ),
    )
    header_timeout_s: float = field(
        default=10.0,
        metadata=_flag(
            "seconds to receive a request's headers (from the connect, or its first byte); a silent connection "
            "is then closed, a partial request gets 408",
            flag="--header-timeout",
        ),
    )
    body_timeout_s: float = field(
        default=60.0,
        metadata=_flag(
            "seconds to receive a request's whole body after its headers; then 408 and the connection is closed",
            flag="--body-timeout",
        ),
    )
    max_connections: int | None = field(
        default=None,
        metadata=_flag(
            "open connections per HTTP process (each API server has its own); a connection over it gets 503 "
            "and is closed (default: what the open-file limit leaves room for)"
        ),
    )
    engine_stall_timeout_s: float = field(
        default=60.0,
        metadata=_flag(
            "seconds the engine loop may go without a turn (it turns every 50 ms idle, once per step busy) "
            "before /health and /ready say 503 engine_stalled and, with --api-server-count, the core is "
            "restarted; >= 1",
            flag="--engine-stall-timeout",
        ),
    )
    core_restart_limit: int = field(
        default=5,
        metadata=_flag(
            "engine-core deaths (crash or stall) the launcher restarts within --core-restart-window; one more "
            "and it exits with status 1"
        ),
    )
    core_restart_window_s: float = field(
        default=600.0, metadata=_flag("seconds over which core deaths are counted", flag="--core-restart-window")
    )

    allowed_origins: tuple[str, ...] = field(
        default=(),
        metadata=_flag(
            "origins a browser may call this server from, as a JSON list or comma-separated ('*' = any); "
            "CORS is off (no CORS headers, preflights get 405) while this is empty",
            parse_list,
        ),
    )
    allowed_methods: tuple[str, ...] = field(
        default=("*",), metadata=_flag("HTTP methods allowed cross-origin (JSON list or comma-separated)", parse_list)
    )
    allowed_headers: tuple[str, ...] = field(
        default=("*",),
        metadata=_flag("request headers allowed cross-origin (JSON list or comma-separated)", parse_list),
    )
    allow_credentials: bool = field(
        default=False,
        metadata=_flag("let cross-origin requests carry cookies and HTTP authentication (CORS credentials)"),
    )
    strict_request_fields: bool = field(
        default=False,
        metadata=_flag(
            "answer unknown fields in a synthesis body with 400 (default: they are ignored, logged once per "
            "field name and named in the X-Ignored-Fields response header)"
        ),
    )

    def __post_init__(self) -> None:
        for name in ("requests_per_minute", "chars_per_minute"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        for name in ("max_input_chars", "max_body_bytes", "max_upload_bytes", "max_in_flight"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("timeout_keep_alive_s", "header_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError("max_connections must be >= 1")
        if self.engine_stall_timeout_s < 1:
            raise ValueError("engine_stall_timeout_s must be >= 1")
        if self.core_restart_limit < 0 or self.core_restart_window_s <= 0:
            raise ValueError("core_restart_limit must be >= 0 and core_restart_window_s > 0")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        for name in ("request_timeout_s", "max_audio_seconds"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")


# Where to listen, and how loud: flags of `serve` that are not ServerConfig's. (dest, converter, default, help)
_LISTEN_FLAGS: list[tuple[str, object, object, str]] = [
    ("host", str, "127.0.0.1", "address to bind (0.0.0.0 for all interfaces)"),
    ("port", int, 8000, "TCP port"),
    ("log_level", str, "info", "debug | info | warning | error"),
]


def _server_flags() -> list[tuple[str, str, object, object, str]]:
    """(dest, flag, converter, default, help) for every flag of the server group, env var TTSSERVE_<DEST>."""
    out = [(dest, "--" + dest.replace("_", "-"), conv, default, text) for dest, conv, default, text in _LISTEN_FLAGS]
    for f in dataclasses.fields(ServerConfig):
        if not f.metadata:  # the list-valued fields (api_keys, served_model_names) have flags of their own
            continue
        m = f.metadata
        default = f.default if m["cli_default"] is dataclasses.MISSING else m["cli_default"]
        conv = m["parse"] or {"int": int, "float": float, "bool": parse_bool}.get(
            str(f.type).replace("| None", "").strip(), str
        )
        out.append((f.name, m["flag"] or "--" + f.name.replace("_", "-"), conv, default, m["help"]))
    return out


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    srv = parser.add_argument_group("server (each flag also reads TTSSERVE_<NAME>)")
    for dest, flag, conv, default, helptext in _server_flags():
        text = f"{helptext} [env {ENV_PREFIX + dest.upper()}; default {default!r}]"
        if conv is parse_bool:
            srv.add_argument(flag, dest=dest, default=None, action=argparse.BooleanOptionalAction, help=text)
        else:
            srv.add_argument(flag, dest=dest, default=None, help=text)
    srv.add_argument(
        "--api-key",
        dest="api_key",
        action="append",
        default=None,
        help="accepted Bearer key; repeat or comma-separate for several; a blank one is refused [env TTSSERVE_API_KEY]",
    )
    srv.add_argument(
        "--admin-api-key",
        dest="admin_api_key",
        action="append",
        default=None,
        help="an API key that also sees, uses and deletes every key's voices, and whose voices every key sees "
        "(repeat or comma-separate; also accepted as an API key) [env TTSSERVE_ADMIN_API_KEY]",
    )
    srv.add_argument(
        "--served-model-name",
        dest="served_model_name",
        action="append",
        default=None,
        help="accepted `model` names (repeatable; default: the model's name + tts-1, tts-1-hd, "
        "gpt-4o-mini-tts) [env TTSSERVE_SERVED_MODEL_NAME, comma list]",
    )
    return parser


def add_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every EngineConfig knob and every server setting as a flag and a TTSSERVE_* env var."""
    add_model_args(parser, env=True)
    add_engine_args(parser, env=True)
    return add_server_args(parser)


def _list_value(args: argparse.Namespace, dest: str, env_name: str, env: dict[str, str]) -> tuple[str, ...]:
    items = getattr(args, dest, None)
    if items is None:
        items = [env.get(env_name, "")]
    return tuple(x.strip() for item in items for x in item.split(",") if x.strip())


def _api_keys(args: argparse.Namespace, env: dict[str, str], dest: str = "api_key") -> tuple[str, ...]:
    """--api-key values (each may be a comma list), else $TTSSERVE_API_KEY; () when neither is given
    (dest="admin_api_key": the same for --admin-api-key).

    A blank key (`--api-key ""`, `TTSSERVE_API_KEY=""`, the empty item of "k1,") is a ValueError: an
    operator who passes a key means to turn authentication on, and a key lost to an unset shell variable
    must not leave the server open (or be silently dropped from the list)."""
    items, source = getattr(args, dest, None), "--" + dest.replace("_", "-")
    if items is None:
        raw = env.get(ENV_PREFIX + dest.upper())
        if raw is None:
            return ()
        items, source = [raw], ENV_PREFIX + dest.upper()
    keys = [x.strip() for item in items for x in item.split(",")]
    if not all(keys):  # the message never echoes keys: they are secrets, and stderr ends up in logs
        blank = ", ".join(str(i + 1) for i, k in enumerate(keys) if not k)
        raise ValueError(
            f"{source}: key {blank} of {len(keys)} is blank; every API key must be non-empty "
            f"(leave {source} out to serve without authentication)"
        )
    return tuple(keys)


def public_url(host: str, port: int) -> str:
    """The URL a person on this machine opens for a server bound to host:port."""
    if host in ("0.0.0.0", "::", ""):
        host = "localhost"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


VOICES_DIR = os.path.join("~", ".local", "share", "ttsserve")


def default_voices_db(port: int) -> str:
    """The voices file of a server on `port` when --voices-db is not given: one per port."""
    return os.path.join(os.path.expanduser(VOICES_DIR), f"voices-{port}.db")


def build_configs(args: argparse.Namespace, env: dict[str, str] | None = None):
    """-> (EngineConfig, ServerConfig, host, port, log_level). ValueError for bad values (names the source),
    and for a PostgreSQL --voices-db that cannot be used (preflight.check_voices_db connects to it)."""
    env = dict(os.environ if env is None else env)
    # A server captures each CUDA-graph family's largest bucket before /ready and the rest between its first
    # steps (engine/deferred_capture.py): 7-9 s off an H200 start (docs/DEPLOY.md, cold start).
    # An Engine driven directly (bench offline, tests) keeps EngineConfig's default: every graph up front.
    engine_cfg = EngineConfig(**({"background_graph_capture": True} | engine_kwargs(args, env)))
    srv = {}
    for dest, _flag_name, conv, default, _help in _server_flags():
        value = read_value(args, dest, conv, env)
        srv[dest] = default if value is None else value
    host, port, log_level = srv.pop("host"), srv.pop("port"), srv.pop("log_level")
    if srv["max_in_flight"] is None:
        srv["max_in_flight"] = engine_cfg.max_queue_len
    if srv["voices_db"] is None:
        srv["voices_db"] = default_voices_db(port)
    server_cfg = ServerConfig(
        api_keys=_api_keys(args, env),
        admin_api_keys=_api_keys(args, env, "admin_api_key"),
        served_model_names=_list_value(args, "served_model_name", ENV_PREFIX + "SERVED_MODEL_NAME", env),
        **srv,
    )
    if not (0 < port < 65536):
        raise ValueError(f"--port must be in 1..65535, got {port}")
    check_voices_db(server_cfg.voices_db)
    return engine_cfg, server_cfg, host, port, log_level

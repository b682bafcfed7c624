"""`ttsserve serve`: the serve topology. One process (the HTTP app around an in-process AsyncEngine), or the
engine core in its own process behind N API-server processes (api_servers.py), or M data-parallel engine
cores (one per GPU) behind those API servers (data_parallel.py). The flags are server/args.py's.

    ttsserve serve --model ./asset --port 8000 --api-key k1,k2 --requests-per-minute 60
    python -m ttsserve.entrypoints.serve --load-format dummy --dummy-size tiny --device cpu
"""

from __future__ import annotations

import argparse
import logging
import sys

from ttsserve.entrypoints.api_servers import add_api_server_args, api_server_count, run_api_servers
from ttsserve.entrypoints.data_parallel import add_data_parallel_args, data_parallel_size, plan_cores, visible_gpus
from ttsserve.server.args import add_serve_arguments, build_configs, public_url
from ttsserve.server.paths import log_outside_paths
from ttsserve.server.preflight import REUSE_PORT_BALANCES, bind_socket, check_engine_config

logger = logging.getLogger("ttsserve.server")


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Mount `serve` on a subparsers object (entrypoints/cli.py); the parser's `func` is run_serve."""
    p = subparsers.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_serve_arguments(p)
    add_data_parallel_args(p)
    add_api_server_args(p)
    p.set_defaults(func=run_serve)
    return p


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )


def run_serve(args: argparse.Namespace) -> int:
    """Check the flags and bind the port (fast), load the engine (slow), log how many streams fit, serve until
    SIGINT/SIGTERM, drain, exit. A bad setting is one line on stderr and exit status 2, before the load when
    the weights are not needed to see it."""
    try:
        engine_cfg, server_cfg, host, port, log_level = build_configs(args)
        from ttsserve.config import compile_level, decode_ops_mode

        compile_level()  # a bad $TTSSERVE_CPU_COMPILE or $TTSSERVE_DECODE_OPS is a config error, reported
        decode_ops_mode()  # before the slow load
        api_servers = api_server_count(args)
        cores = data_parallel_size(args)
        core_envs = plan_cores(cores, engine_cfg.device, visible_gpus(engine_cfg.device)) if cores > 1 else None
        if cores > 1:  # the cores run in their own processes: at least one API server in front of them
            api_servers = max(api_servers, 1)
        # Everything that can be checked without the weights, before the slow load: a bad --model, a missing
        # GPU, a taken port. The socket stays bound through the load, so the port cannot be lost meanwhile.
        # With API servers the engine check (which imports torch, seconds) runs while the cores import theirs.
        if api_servers == 0:
            check_engine_config(engine_cfg)
        sock = bind_socket(host, port, reuse_port=api_servers > 1 and REUSE_PORT_BALANCES)
    except ValueError as e:
        return _config_error(e)
    if api_servers > 0:  # the engine core in its own process, N HTTP/encoding processes (api_servers.py)
        try:
            return run_api_servers(
                engine_cfg,
                server_cfg,
                host,
                port,
                log_level,
                api_servers,
                sock,
                core_envs,
                preflight=lambda: check_engine_config(engine_cfg),
            )
        except ValueError as e:  # the pre-flight check (the cores it raced were stopped)
            sock.close()
            return _config_error(e)
    from ttsserve.engine.core.async_engine import AsyncEngine
    from ttsserve.server.app import create_app
    from ttsserve.server.drain import DrainingServer
    from ttsserve.server.http_server import raise_fd_limit, uvicorn_config

    _configure_logging(log_level)
    raise_fd_limit()
    log_outside_paths(engine_cfg, server_cfg)
    from ttsserve.runner.cpu_threads import log_cpu_step_mode

    log_cpu_step_mode(engine_cfg)
    logger.info("loading model (%s)", engine_cfg.model or engine_cfg.load_format)
    try:
        engine = AsyncEngine.from_config(engine_cfg)
        engine.liveness.stall_timeout_s = server_cfg.engine_stall_timeout_s
    except ValueError as e:  # what only the checkpoint's contents reveal (a bad tensor, a quantization mismatch)
        sock.close()
        return _config_error(e)
    app = create_app(engine, server_cfg)  # its lifespan logs engine.memory_report() (how many streams fit)
    app.state.public_url = public_url(host, port)  # and, once ready, the playground's and the docs' URLs
    from ttsserve.engine.core.heap import freeze_startup_heap

    freeze_startup_heap("server", step_loop=True)  # the engine steps on a thread of this process
    # SIGTERM drains (server/drain.py: new requests get 503 while accepted ones finish, up to the drain timeout)
    # and the exit status is 0, as under the launcher.
    config = uvicorn_config(app, server_cfg, log_level)
    shown = f"[{host}]" if ":" in host else host
    logger.info("serving on http://%s:%d once the engine is up (Ctrl+C to quit)", shown, port)
    # exits 3 itself if the app fails to start (as uvicorn.run)
    DrainingServer(config, app.state.drain, server_cfg.drain_timeout_s).run(sockets=[sock])
    return 0


def _config_error(e: ValueError) -> int:
    print(f"ttsserve serve: error: {e}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ttsserve serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_serve_arguments(parser)
    add_data_parallel_args(parser)
    add_api_server_args(parser)
    return run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

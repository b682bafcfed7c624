"""`ttsserve serve` flags and TTSSERVE_* environment variables -> EngineConfig + ServerConfig."""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys

import pytest

from ttsserve.config import EngineConfig
from ttsserve.engine.args import parse_size
from ttsserve.entrypoints.serve import add_serve_parser, run_serve
from ttsserve.server.args import add_serve_arguments, build_configs


def _parse(argv: list[str], env: dict | None = None):
    args = add_serve_arguments(argparse.ArgumentParser()).parse_args(argv)
    return build_configs(args, env=env or {})


def test_every_engine_knob_is_a_flag():
    parser = add_serve_arguments(argparse.ArgumentParser())
    flags = {opt for action in parser._actions for opt in action.option_strings}
    for f in dataclasses.fields(EngineConfig):
        assert "--" + f.name.replace("_", "-") in flags, f.name
    assert {
        "--no-enable-chunked-prefill",
        "--api-key",
        "--voices-db",
        "--max-input-chars",
        "--requests-per-minute",
        "--chars-per-minute",
        "--max-in-flight",
        "--host",
        "--port",
    } <= flags


def test_flags_map_onto_configs(tmp_path):
    eng, srv, host, port, level = _parse(
        [
            "--model",
            "/m",
            "--block-size",
            "32",
            "--gpu-memory-utilization",
            "0.5",
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "8192",
            "--no-enable-chunked-prefill",
            "--swap-space",
            "2.5",
            "--dtype",
            "float16",
            "--device",
            "cpu",
            "--load-format",
            "dummy",
            "--dummy-size",
            "tiny",
            "--quantization",
            "int8",
            "--kv-cache-memory",
            "1.5GiB",
            "--target-step-latency-ms",
            "40",
            "--max-queue-len",
            "64",
            "--host",
            "0.0.0.0",
            "--port",
            "9001",
            "--api-key",
            "a,b",
            "--api-key",
            "c",
            "--requests-per-minute",
            "60",
            "--chars-per-minute",
            "5000",
            "--voices-db",
            str(tmp_path / "sub" / "v.db"),
            "--max-input-chars",
            "1000",
            "--served-model-name",
            "chattts",
            "--max-new-tokens",
            "512",
            "--drain-timeout",
            "5",
            "--log-level",
            "debug",
        ]
    )
    assert (eng.model, eng.block_size, eng.gpu_memory_utilization, eng.max_num_seqs) == ("/m", 32, 0.5, 8)
    assert (eng.enable_chunked_prefill, eng.swap_space, eng.dtype, eng.device) == (False, 2.5, "float16", "cpu")
    assert (eng.load_format, eng.dummy_size, eng.quantization) == ("dummy", "tiny", "int8")
    assert eng.kv_cache_memory == int(1.5 * 2**30) and eng.target_step_latency_ms == 40 and eng.max_queue_len == 64
    assert (host, port, level) == ("0.0.0.0", 9001, "debug")
    assert srv.api_keys == ("a", "b", "c") and srv.requests_per_minute == 60 and srv.chars_per_minute == 5000
    assert srv.max_in_flight == 64  # defaults to the engine's queue bound
    assert srv.voices_db == str(tmp_path / "sub" / "v.db")
    assert (srv.max_input_chars, srv.served_model_names, srv.max_new_tokens, srv.drain_timeout_s) == (
        1000,
        ("chattts",),
        512,
        5.0,
    )


def test_env_vars_and_precedence():
    env = {
        "TTSSERVE_MAX_NUM_SEQS": "7",
        "TTSSERVE_ENABLE_PREFIX_CACHING": "false",
        "TTSSERVE_BLOCK_SIZE": "64",
        "TTSSERVE_API_KEY": "x, y",
        "TTSSERVE_PORT": "8123",
        "TTSSERVE_VOICES_DB": ":memory:",
        "TTSSERVE_KV_CACHE_MEMORY": "512M",
        "TTSSERVE_MAX_IN_FLIGHT": "3",
    }
    eng, srv, _host, port, _ = _parse(["--block-size", "8"], env)
    assert eng.max_num_seqs == 7 and eng.enable_prefix_caching is False and eng.kv_cache_memory == 512 * 2**20
    assert eng.block_size == 8  # the flag beats the environment
    assert srv.api_keys == ("x", "y") and port == 8123 and srv.max_in_flight == 3
    eng, srv, *_ = _parse([], {})
    # nothing given: EngineConfig's own defaults, but for the server's deferred graph captures
    assert eng == EngineConfig(background_graph_capture=True)
    assert srv.voices_db.endswith("/.local/share/ttsserve/voices-8000.db") and srv.api_keys == ()


@pytest.mark.parametrize(
    "argv, env, needle",
    [
        (["--block-size", "7"], {}, "block_size"),
        (["--max-num-seqs", "many"], {}, "--max-num-seqs"),
        ([], {"TTSSERVE_PORT": "http"}, "TTSSERVE_PORT"),
        ([], {"TTSSERVE_ENFORCE_EAGER": "maybe"}, "TTSSERVE_ENFORCE_EAGER"),
        (["--kv-cache-memory", "lots"], {}, "--kv-cache-memory"),
        (["--port", "70000", "--voices-db", ":memory:"], {}, "--port"),
        (["--engine-stall-timeout", "0.5"], {}, "engine_stall_timeout_s"),
        ([], {"TTSSERVE_CORE_RESTART_LIMIT": "-1"}, "core_restart_limit"),
    ],
)
def test_bad_values_name_their_source(argv, env, needle):
    with pytest.raises(ValueError, match=needle):
        _parse(argv, env)


def test_run_serve_reports_bad_config(capsys):
    args = add_serve_arguments(argparse.ArgumentParser()).parse_args(["--block-size", "7"])
    assert run_serve(args) == 2
    assert "block_size" in capsys.readouterr().err


def test_parse_size():
    assert parse_size("1024") == 1024 and parse_size("4GiB") == 4 * 2**30 and parse_size("2k") == 2048
    with pytest.raises(ValueError):
        parse_size("-1G")


def test_run_serve_reports_a_bad_compile_level(capsys, monkeypatch):
    monkeypatch.setenv("TTSSERVE_CPU_COMPILE", "yes")
    args = add_serve_arguments(argparse.ArgumentParser()).parse_args(["--load-format", "dummy", "--dummy-size", "tiny"])
    assert run_serve(args) == 2
    assert "TTSSERVE_CPU_COMPILE must be one of 0, attention, 1, got 'yes'" in capsys.readouterr().err


def test_run_serve_reports_bad_decode_ops(capsys, monkeypatch):
    monkeypatch.setenv("TTSSERVE_DECODE_OPS", "fast")
    args = add_serve_arguments(argparse.ArgumentParser()).parse_args(["--load-format", "dummy", "--dummy-size", "tiny"])
    assert run_serve(args) == 2
    err = capsys.readouterr().err
    modes = "triton, triton-compiled-sampler, triton-eager-sampler, compile"
    assert f"TTSSERVE_DECODE_OPS must be one of {modes}, got 'fast'" in err


def test_mounts_as_subcommand_and_runs_as_module():
    root = argparse.ArgumentParser(prog="ttsserve")
    add_serve_parser(root.add_subparsers(dest="cmd"))
    args = root.parse_args(["serve", "--port", "1234"])
    assert args.func is run_serve and args.port == "1234"
    out = subprocess.run(
        [sys.executable, "-m", "ttsserve.entrypoints.serve", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and "--gpu-memory-utilization" in out.stdout and "TTSSERVE_API_KEY" in out.stdout


def test_a_cpu_server_runs_eager_unless_told_to_compile(monkeypatch, caplog) -> None:
    import logging

    from ttsserve.config import EngineConfig
    from ttsserve.runner.cpu_threads import log_cpu_step_mode

    monkeypatch.delenv("TTSSERVE_CPU_COMPILE", raising=False)
    with caplog.at_level(logging.INFO, logger="ttsserve.server"):
        log_cpu_step_mode(EngineConfig(device="cpu"))
    assert "TTSSERVE_CPU_COMPILE" not in os.environ and "CPU: the decode step runs eager" in caplog.text
    caplog.clear()
    monkeypatch.setenv("TTSSERVE_CPU_COMPILE", "1")
    with caplog.at_level(logging.INFO, logger="ttsserve.server"):
        log_cpu_step_mode(EngineConfig(device="cpu"))
    assert os.environ["TTSSERVE_CPU_COMPILE"] == "1" and "compiling before /ready" in caplog.text
    caplog.clear()
    log_cpu_step_mode(EngineConfig(device="cuda"))
    assert caplog.text == ""

"""The CLI's small things: --version, help texts that say what an option does, `say` sized for one request with a
progress total of the expected frames, and the per-port voices file."""

from __future__ import annotations

import argparse
import logging

import pytest

from ttsserve import __version__
from ttsserve.entrypoints.cli import build_parser, main
from ttsserve.server.args import add_serve_arguments, build_configs, public_url

TINY = ["--load-format", "dummy", "--dummy-size", "tiny", "--device", "cpu"]


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"ttsserve {__version__}"


def _parsers(p: argparse.ArgumentParser, name: str = "ttsserve"):
    yield name, p
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


def test_every_option_says_what_it_does():
    """No option without help, and none whose help only repeats its name ("max model len")."""
    bare = []
    for name, p in _parsers(build_parser()):
        for a in p._actions:
            if not a.option_strings or isinstance(a, (argparse._HelpAction, argparse._VersionAction)):
                continue
            flag = max(a.option_strings, key=len)
            words = flag.lstrip("-").replace("-", " ")
            text = (a.help or "").split(" [env ")[0].strip()
            if not text or text == words or text == words.replace("no ", "", 1):
                bare.append(f"{name} {flag}")
    assert not bare, bare


def test_say_sizes_its_kv_cache_for_the_request(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    out = tmp_path / "a.wav"
    assert main(["say", "Hello there. This is a small test.", "-o", str(out), *TINY]) == 0 and out.exists()
    kv = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:"))
    # one or two segments of at most 4096 positions: 256 blocks of 16 each, and no swap pool
    assert kv.startswith(("KV cache: 256 blocks", "KV cache: 512 blocks")) and "swap space 0 blocks" in kv, kv


def test_progress_total_is_the_expected_frames():
    from ttsserve import TTS, SamplingParams

    tts = TTS(load_format="dummy", dummy_size="tiny", device="cpu", max_num_seqs=2, swap_space=0.0)
    calls = []
    (wav,) = tts.generate(
        "Hello there, a progress test.", SamplingParams(seed=3), progress=lambda d, t: calls.append((d, t))
    )
    done = next(iter(tts.last_results.values())).num_frames
    assert calls[-1] == (done, done)  # the bar ends full, at the frames made
    assert all(d <= t < 2048 for d, t in calls)  # never the cap (2048 per segment) as the total
    assert tts.engine.kv_spec.num_blocks == 2 * 4096 // 16  # max_num_seqs full sequences, not 1 GiB


def test_voices_file_is_per_port_and_urls():
    parser = add_serve_arguments(argparse.ArgumentParser())
    _, cfg, *_ = build_configs(parser.parse_args(["--port", "8123"]), env={})
    assert cfg.voices_db.endswith("/.local/share/ttsserve/voices-8123.db")
    _, cfg, *_ = build_configs(parser.parse_args(["--port", "8123"]), env={"TTSSERVE_VOICES_DB": "/x/v.db"})
    assert cfg.voices_db == "/x/v.db"
    assert public_url("0.0.0.0", 80) == "http://localhost:80" and public_url("::1", 8) == "http://[::1]:8"

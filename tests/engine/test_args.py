"""engine/args.py: the model / engine flags every command gets from EngineConfig's fields."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from ttsserve.config import EngineConfig
from ttsserve.engine.args import MODEL_FIELDS, add_engine_args, add_model_args, engine_kwargs
from ttsserve.entrypoints.cli import build_parser


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {opt for action in parser._actions for opt in action.option_strings}


def test_every_field_is_a_flag_with_the_config_default() -> None:
    p = argparse.ArgumentParser()
    add_model_args(p)
    add_engine_args(p)
    assert {"--" + f.name.replace("_", "-") for f in dataclasses.fields(EngineConfig)} <= _flags(p)
    assert EngineConfig(**engine_kwargs(p.parse_args([]))) == EngineConfig()


def test_flags_are_typed_and_checked() -> None:
    p = argparse.ArgumentParser()
    add_model_args(p)
    add_engine_args(p)
    a = p.parse_args(
        [
            "--block-size",
            "32",
            "--kv-cache-memory",
            "1.5G",
            "--no-enable-prefix-caching",
            "--lookahead-frames",
            "8",
            "--dtype",
            "bfloat16",
        ]
    )
    cfg = EngineConfig(**engine_kwargs(a))
    assert (cfg.block_size, cfg.kv_cache_memory, cfg.enable_prefix_caching, cfg.lookahead_frames, cfg.dtype) == (
        32,
        int(1.5 * 2**30),
        False,
        8,
        "bfloat16",
    )
    for bad in (["--block-size", "x"], ["--dtype", "int3"], ["--kv-cache-memory", "lots"]):
        with pytest.raises(SystemExit):
            p.parse_args(bad)


def test_only_generated_flags_reach_the_engine_config() -> None:
    """`say --seed` is the sampling seed: it must not reseed the dummy weights."""
    a = build_parser().parse_args(["say", "hi", "--seed", "5", "--load-format", "dummy", "--dummy-size", "tiny"])
    kw = engine_kwargs(a)
    assert "seed" not in kw and kw["load_format"] == "dummy" and kw["dummy_size"] == "tiny"
    assert set(kw) <= set(MODEL_FIELDS)


@pytest.mark.parametrize(
    "argv",
    [
        ["say", "hi"],
        ["bench", "offline"],
        ["quantize", "--method", "int8", "--out", "x"],
        ["bench", "quality"],
    ],
)
def test_every_command_reads_the_model_flags(argv: list[str]) -> None:
    a = build_parser().parse_args([*argv, "--model", "/m", "--load-format", "dummy", "--dummy-size", "tiny"])
    assert engine_kwargs(a) | {"model": "/m"} == engine_kwargs(a)
    assert (a.model, a.load_format, a.dummy_size) == ("/m", "dummy", "tiny")


def test_command_defaults_are_kept() -> None:
    """quantize and bench quality calibrate / compare on the CPU unless told otherwise."""
    parser = build_parser()
    assert parser.parse_args(["quantize", "--method", "int8", "--out", "x"]).device == "cpu"
    assert parser.parse_args(["bench", "quality"]).device == "cpu"
    assert parser.parse_args(["say", "hi"]).device == "auto"

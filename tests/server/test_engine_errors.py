"""Typed engine errors: raise sites name the field, ErrorInfo carries kind and param across the wire, and the
server maps them with one table (server/errors.engine_error), never from the message text."""

from __future__ import annotations

import msgspec
import pytest

from ttsserve.engine.core.messages import ErrorInfo, encoder
from ttsserve.engine.errors import (
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
)
from ttsserve.params import SamplingParams, SynthesisRequest
from ttsserve.server.errors import ApiError, engine_error
from ttsserve.text.segments import prepare_segments


@pytest.mark.parametrize(
    ("make", "param"),
    [
        (lambda: SamplingParams(temperature=0.0), "temperature"),
        (lambda: SamplingParams(temperature=(0.1, 0.2)), "temperature"),
        (lambda: SamplingParams(top_p=2.0), "top_p"),
        (lambda: SamplingParams(top_k=0), "top_k"),
        (lambda: SamplingParams(max_new_tokens=4, min_new_tokens=5), "min_new_tokens"),
        (lambda: SamplingParams(seed=-1), "seed"),
        (lambda: SynthesisRequest(" "), "text"),
        (lambda: prepare_segments(SynthesisRequest("?!")), "text"),
        (lambda: prepare_segments(SynthesisRequest("hi", code_prompt="[oral_1]")), "code_prompt"),
        (
            lambda: prepare_segments(SynthesisRequest("hi", refine_text=True, refine_prompt="[speed_1]")),
            "refine_prompt",
        ),
    ],
)
def test_raise_sites_name_the_field(make, param):
    with pytest.raises(InvalidRequestError) as info:
        make()
    assert info.value.param == param and isinstance(info.value, ValueError)


def test_errors_cross_the_wire_with_kind_and_param():
    cases = [
        InvalidRequestError("bad top_p", "top_p"),
        InvalidRequestError("no field"),
        ValueError("plain"),
        EngineOverloadedError("full"),
        EngineDeadError("gone"),
        KeyError("k"),
    ]
    for e in cases:
        info = msgspec.msgpack.decode(encoder.encode(ErrorInfo.of(e)), type=ErrorInfo)
        back = info.exception()
        if isinstance(e, ValueError):
            assert type(back) is InvalidRequestError and str(back) == str(e)
            assert back.param == (e.param if isinstance(e, InvalidRequestError) else None)
        elif isinstance(e, EngineOverloadedError):
            assert type(back) is type(e) and str(back) == str(e)
        else:
            assert type(back) is RuntimeError and str(back) == "KeyError: 'k'"


def test_one_table_maps_engine_errors_to_http():
    bad = engine_error(InvalidRequestError("top_k must be >= 1", "top_k"), "top_k")
    assert isinstance(bad, ApiError) and (bad.status, bad.param, bad.code) == (400, "top_k", "invalid_value")
    dead = engine_error(EngineDeadError("the engine core process is gone"), "input")
    assert isinstance(dead, ApiError) and (dead.status, dead.code, dead.param) == (503, "engine_dead", None)
    full = engine_error(EngineOverloadedError("too many requests in flight (2)"))
    assert isinstance(full, ApiError) and (full.status, full.code) == (503, "server_overloaded")
    assert full.headers["Retry-After"] == "1"
    other = RuntimeError("internal")
    assert engine_error(other) is other  # not an engine error: left for the 500 handler

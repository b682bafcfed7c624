"""CORS: off by default (no CORS headers, a preflight is a 405); --allowed-origins turns Starlette's middleware on,
with vLLM's flag names and JSON-list or comma values."""

from __future__ import annotations

import json
import logging

import pytest

from ttsserve.server.args import ServerConfig, add_serve_arguments, build_configs, parse_list

PAGE = "http://page.example"
PREFLIGHT = {
    "Origin": PAGE,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization,content-type",
}
SPEECH = {"model": "tts-1", "input": "Hello.", "voice": "alloy", "response_format": "pcm"}


def _cors_headers(r) -> dict:
    return {k: v for k, v in r.headers.items() if k.startswith("access-control-")}


def test_cors_is_off_by_default(serve):
    srv, _ = serve()
    with srv.client() as c:
        r = c.options("/v1/audio/speech", headers=PREFLIGHT)
        assert r.status_code == 405 and _cors_headers(r) == {}
        r = c.post("/v1/audio/speech", json=SPEECH, headers={"Origin": PAGE})
        assert r.status_code == 200 and _cors_headers(r) == {}


def test_preflight_and_simple_requests_get_the_headers(serve, caplog):
    srv, _ = serve(allowed_origins=(PAGE,), api_keys=("k",))
    caplog.set_level(logging.INFO)
    with srv.client() as c:
        r = c.options("/v1/audio/speech", headers=PREFLIGHT)
        assert r.status_code == 200, r.text  # no key needed for a preflight
        h = _cors_headers(r)
        assert h["access-control-allow-origin"] == PAGE and "POST" in h["access-control-allow-methods"]
        assert "authorization" in h["access-control-allow-headers"].lower()
        auth = {"Origin": PAGE, "Authorization": "Bearer k"}
        r = c.post("/v1/audio/speech", json={**SPEECH, "user": "x"}, headers=auth)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == PAGE
        exposed = r.headers["access-control-expose-headers"].lower()
        assert "x-ignored-fields" in exposed and "x-request-id" in exposed
        r = c.get("/v1/audio/voices", headers={"Origin": PAGE})  # errors carry the headers too
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == PAGE
        r = c.options("/v1/audio/speech", headers={**PREFLIGHT, "Origin": "http://evil.example"})
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    lines = [json.loads(x.getMessage()) for x in caplog.records if x.name == "ttsserve.access"]
    refused = [x for x in lines if x.get("status") == 400]
    assert refused and "CORS preflight refused" in refused[0]["reason"]


def test_any_origin_with_credentials_and_restricted_methods(serve):
    srv, _ = serve(allowed_origins=("*",), allowed_methods=("GET",), allow_credentials=True)
    with srv.client() as c:
        r = c.options("/v1/models", headers={**PREFLIGHT, "Access-Control-Request-Method": "GET"})
        # with credentials a "*" origin is echoed (browsers refuse "*" with credentials)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == PAGE
        assert r.headers["access-control-allow-credentials"] == "true"
        assert c.options("/v1/audio/speech", headers=PREFLIGHT).status_code == 400  # POST not allowed


def test_flags_take_json_lists_or_commas():
    import argparse

    parser = add_serve_arguments(argparse.ArgumentParser())
    args = parser.parse_args(
        ["--allowed-origins", '["http://a.example", "http://b.example"]', "--allowed-methods", "GET, POST"]
    )
    _, cfg, *_ = build_configs(args, env={"TTSSERVE_ALLOWED_HEADERS": "content-type,authorization"})
    assert cfg.allowed_origins == ("http://a.example", "http://b.example")
    assert cfg.allowed_methods == ("GET", "POST")
    assert cfg.allowed_headers == ("content-type", "authorization")
    assert not cfg.allow_credentials and ServerConfig().allowed_origins == ()
    _, cfg, *_ = build_configs(parser.parse_args(["--allow-credentials"]), env={})
    assert cfg.allow_credentials and cfg.allowed_origins == ()
    for bad in ('["a", 1]', "[not json"):
        with pytest.raises(ValueError, match="allowed-origins"):
            build_configs(parser.parse_args(["--allowed-origins", bad]), env={})
    assert parse_list(" a ,, b ") == ("a", "b")

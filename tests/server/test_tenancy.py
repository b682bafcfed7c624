"""Tenancy: voices belong to the API key that made them, admin keys and built-ins are shared, and the docs and
metrics can be put behind a key. Over HTTP against a live server; the voice store's migration on a file."""

from __future__ import annotations

import sqlite3

import httpx
import pytest

from ttsserve.server.args import ServerConfig, add_serve_arguments, build_configs
from ttsserve.server.limits import key_id
from ttsserve.server.voice_store_sqlite import SqliteVoiceStore

KEYS = {"k1": "key-one", "k2": "key-two", "admin": "key-admin"}
SPEECH = {"model": "tts-1", "input": "Hello there.", "response_format": "pcm"}


def _client(srv, who: str) -> httpx.Client:
    return srv.client(headers={"Authorization": f"Bearer {KEYS[who]}"})


@pytest.fixture
def tenants(serve, tmp_path):
    srv, _ = serve(api_keys=(KEYS["k1"], KEYS["k2"]), admin_api_keys=(KEYS["admin"],), voices_db=str(tmp_path / "v.db"))
    clients = {who: _client(srv, who) for who in KEYS}
    yield srv, clients
    for c in clients.values():
        c.close()


def _names(c: httpx.Client) -> set[str]:
    r = c.get("/v1/audio/voices")
    assert r.status_code == 200, r.text
    return {v["name"] for v in r.json()["data"] if v["type"] != "builtin"}


def test_a_keys_voice_is_invisible_to_another_key(tenants, tmp_path):
    srv, c = tenants
    mine = c["k1"].post("/v1/audio/voices", json={"name": "mine", "seed": 5}).json()
    assert _names(c["k1"]) == {"mine"} and _names(c["k2"]) == set()
    # another key's voice is a 404 exactly like a missing one, by id and by name, everywhere
    missing = c["k2"].get("/v1/audio/voices/voice_doesnotexist").json()["error"]
    for ref in (mine["id"], "mine"):
        r = c["k2"].get(f"/v1/audio/voices/{ref}")
        assert r.status_code == 404 and r.json()["error"]["code"] == missing["code"] == "voice_not_found"
        r = c["k2"].post("/v1/audio/speech", json={**SPEECH, "voice": ref})
        assert r.status_code == 404 and r.json()["error"]["code"] == "voice_not_found"
        r = c["k2"].post("/v1/audio/speech", json={**SPEECH, "voice": {"id": ref}})
        assert r.status_code == 404
    r = c["k2"].delete(f"/v1/audio/voices/{mine['id']}")
    assert r.status_code == 404 and r.json()["error"]["code"] == "voice_not_found"
    # the owner still has it, uses it and deletes it
    assert c["k1"].get(f"/v1/audio/voices/{mine['id']}").status_code == 200
    assert c["k1"].post("/v1/audio/speech", json={**SPEECH, "voice": "mine"}).status_code == 200
    assert c["k1"].delete(f"/v1/audio/voices/{mine['id']}").status_code == 200
    # the owner is stored as the key's hash, never the key
    c["k2"].post("/v1/audio/voices", json={"name": "theirs", "seed": 6})
    db = sqlite3.connect(tmp_path / "v.db")
    owners = {name: owner for name, owner in db.execute("SELECT name, owner FROM voices")}
    db.close()
    assert owners == {"theirs": key_id(KEYS["k2"])}
    assert all(k not in repr(owners) for k in KEYS.values())


def test_admin_voices_and_builtins_are_visible_to_all_and_admin_sees_all(tenants):
    srv, c = tenants
    shared = c["admin"].post("/v1/audio/voices", json={"name": "shared", "seed": 1}).json()
    c["k1"].post("/v1/audio/voices", json={"name": "private", "seed": 2})
    assert _names(c["k1"]) == {"shared", "private"} and _names(c["k2"]) == {"shared"}
    assert _names(c["admin"]) == {"shared", "private"}
    for who in ("k1", "k2"):
        assert c[who].post("/v1/audio/speech", json={**SPEECH, "voice": "shared"}).status_code == 200
        assert c[who].post("/v1/audio/speech", json={**SPEECH, "voice": "nova"}).status_code == 200
    assert c["admin"].post("/v1/audio/speech", json={**SPEECH, "voice": "private"}).status_code == 200
    # a plain key may not delete a public voice; the admin key may delete anyone's
    r = c["k2"].delete(f"/v1/audio/voices/{shared['id']}")
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
    private = c["admin"].get("/v1/audio/voices/private").json()
    assert c["admin"].delete(f"/v1/audio/voices/{private['id']}").status_code == 200
    assert _names(c["k1"]) == {"shared"}


def test_docs_and_metrics_are_open_by_default(serve):
    srv, _ = serve(api_keys=("k",))
    with srv.client() as c:
        for path in ("/docs", "/redoc", "/openapi.json", "/metrics", "/health", "/ready"):
            assert c.get(path).status_code == 200, path
        assert c.get("/v1/models").status_code == 401


def test_auth_docs_and_metrics_puts_them_behind_a_key(serve):
    srv, _ = serve(api_keys=("k",), admin_api_keys=("adm",), auth_docs_and_metrics=True)
    with srv.client() as c:
        for path in ("/docs", "/redoc", "/openapi.json", "/metrics"):
            r = c.get(path)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
            assert r.headers["www-authenticate"] == "Bearer"
            for key in ("k", "adm"):
                assert c.get(path, headers={"Authorization": f"Bearer {key}"}).status_code == 200, path
        # probes stay open: an orchestrator has no key
        assert c.get("/health").status_code == 200 and c.get("/ready").status_code == 200


def test_voice_store_migrates_a_database_without_owners(tmp_path):
    path = str(tmp_path / "old.db")
    db = sqlite3.connect(path)
    db.execute(
        "CREATE TABLE voices (id TEXT PRIMARY KEY, name TEXT NOT NULL UNIQUE, type TEXT NOT NULL, "
        "created_at INTEGER NOT NULL, seed INTEGER, spk_emb BLOB, spk_smp BLOB, spk_smp_rows INTEGER, txt_smp TEXT)"
    )
    db.execute("INSERT INTO voices VALUES ('voice_old', 'old', 'seed', 1, 9, NULL, NULL, NULL, NULL)")
    db.commit()
    db.close()
    for _ in range(2):  # the second open finds the column there already
        store = SqliteVoiceStore(path)
        old = store.get("old")
        assert old is not None and old.id == "voice_old" and old.seed == 9 and old.owner is None
        store.close()
    store = SqliteVoiceStore(path)
    store.create("new", "seed", seed=3, owner="key-abc")
    from ttsserve.server.voices import VoiceScope

    assert [r.name for r in store.list(VoiceScope("key-def", False))] == ["old"]
    assert [r.name for r in store.list(VoiceScope("key-abc", False))] == ["old", "new"]
    store.close()


def test_admin_api_key_flag_and_env():
    parser = add_serve_arguments(__import__("argparse").ArgumentParser())
    _, cfg, *_ = build_configs(parser.parse_args(["--admin-api-key", "a1,a2", "--auth-docs-and-metrics"]), env={})
    assert cfg.admin_api_keys == ("a1", "a2") and cfg.auth_docs_and_metrics is True
    _, cfg, *_ = build_configs(parser.parse_args([]), env={"TTSSERVE_ADMIN_API_KEY": "z"})
    assert cfg.admin_api_keys == ("z",) and cfg.auth_docs_and_metrics is False
    with pytest.raises(ValueError, match="blank"):
        build_configs(parser.parse_args(["--admin-api-key", ""]), env={})
    assert ServerConfig().admin_api_keys == ()

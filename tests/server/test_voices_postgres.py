"""Voices in PostgreSQL (--voices-db postgresql://...): the store against both backends, two real servers
sharing one database, concurrent creates of one name, and a bad URL refused at start with its password masked.

The PostgreSQL tests run a real server that this module starts (tests/server/pg_helpers.py) and skip, with the
reason, where that cannot be done. The masking and the SQLite cases run everywhere.
"""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import threading

import httpx
import numpy as np
import pytest

from tests.server.helpers import same_audio
from tests.server.multiproc_helpers import REPO, ServeProcess, free_port
from tests.server.pg_helpers import PostgresServer, unavailable_reason
from tests.tiny_args import TINY_CLI_ARGS
from ttsserve.engine.errors import InvalidRequestError
from ttsserve.server.preflight import check_voices_db
from ttsserve.server.voice_store import mask_url, open_voice_store, redact
from ttsserve.server.voices import VoiceConflictError, VoiceScope

SPEECH = {"model": "tts-1", "input": "Voice test.", "seed": 11, "response_format": "pcm"}


@pytest.fixture(scope="module")
def pg():
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    server = PostgresServer()
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def unit_db(pg) -> str:
    return pg.create_database("unit")


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request, tmp_path) -> str:
    """A --voices-db value naming an empty store: a fresh SQLite file, or the unit database without its table."""
    if request.param == "sqlite":
        return str(tmp_path / "new" / "voices.db")  # the store makes the folder
    pg, url = request.getfixturevalue("pg"), request.getfixturevalue("unit_db")
    with pg.admin("unit") as conn:
        conn.execute("DROP TABLE IF EXISTS voices")
    return url


# ---- masking -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "url, shown",
    [
        ("postgresql://u:pw@h:5432/db", "postgresql://u:***@h:5432/db"),
        ("POSTGRES://u:p%40ss@h/db?sslmode=require", "POSTGRES://u:***@h/db?sslmode=require"),
        ("postgresql://u:p@ss@h/db", "postgresql://u:***@h/db"),  # an unescaped '@': masked whole
        ("postgresql://u@h/db?sslmode=require&password=pw&x=1", "postgresql://u@h/db?sslmode=require&password=***&x=1"),
        ("postgresql://h1:1,h2:2/db", "postgresql://h1:1,h2:2/db"),  # no password: nothing to mask
        ("/var/lib/ttsserve/v:o@ices.db", "/var/lib/ttsserve/v:o@ices.db"),  # a SQLite path is never a URL
    ],
)
def test_mask_url(url, shown):
    assert mask_url(url) == shown


def test_redact_masks_the_password_as_written_and_decoded():
    url = "postgresql://u:p%40ssword@h/db"
    assert redact('bad "p@ssword"\n\tand p%40ssword', url) == 'bad "***" and ***'


def test_check_voices_db_without_psycopg(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "psycopg", None)  # `import psycopg` raises ImportError
    with pytest.raises(ValueError) as e:
        check_voices_db("postgresql://u:hunter2@db.internal/v")
    assert str(e.value) == (
        "--voices-db postgresql://u:***@db.internal/v: needs psycopg 3: pip install 'psycopg[binary]' "
        "(or the ttsserve[postgres] extra)"
    )
    check_voices_db(str(tmp_path / "v.db"))  # a SQLite path needs nothing, and is not created here
    assert not (tmp_path / "v.db").exists()


# ---- the store, both backends ----------------------------------------------------------------------------
def test_store_roundtrip(store_url):
    store = open_voice_store(store_url)
    smp = np.arange(12, dtype=np.int32).reshape(4, 3)
    rec = store.create("ref", "audio_sample", spk_smp=smp, txt_smp="hi")
    emb = np.linspace(-2, 2, 768).astype(np.float16)
    store.create("emb", "seed", seed=2**32 - 1, spk_emb=emb)  # the largest seed a request may give
    store.close()
    store = open_voice_store(store_url)  # a restart reads the same records
    got = store.get(rec.id)
    np.testing.assert_array_equal(got.spk_smp, smp)
    assert got.txt_smp == "hi" and got.spk_emb is None and got.created_at == rec.created_at
    by_name = store.get("emb")
    np.testing.assert_array_equal(by_name.spk_emb, emb)
    assert by_name.seed == 2**32 - 1 and by_name.type == "seed"
    assert [r.name for r in store.list()] == ["ref", "emb"]  # creation order
    assert store.delete(rec.id) and not store.delete(rec.id) and store.get(rec.id) is None
    store.close()


def test_store_names_are_unique_and_checked(store_url):
    store = open_voice_store(store_url)
    store.create("narrator", "seed", seed=1)
    with pytest.raises(VoiceConflictError, match="'narrator' exists already"):
        store.create("narrator", "seed", seed=2, owner="key-a")  # unique across owners too
    with pytest.raises(InvalidRequestError):
        store.create("Alloy", "seed", seed=3)  # a built-in name
    assert store.get("Narrator") is None  # names match exactly, as in SQLite
    store.create("Narrator", "seed", seed=4)
    assert [r.seed for r in store.list()] == [1, 4]
    store.close()


def test_store_owner_scoping(store_url):
    store = open_voice_store(store_url)
    public = store.create("public", "seed", seed=1)
    mine = store.create("mine", "seed", seed=2, owner="key-a")
    store.create("theirs", "seed", seed=3, owner="key-b")
    a, b = VoiceScope("key-a", False), VoiceScope("key-b", False)
    assert [r.name for r in store.list(a)] == ["public", "mine"]
    assert [r.name for r in store.list()] == ["public", "mine", "theirs"]  # admin / no keys: all
    assert store.get("mine", b) is None and store.get(mine.id, b) is None and store.get("mine", a).owner == "key-a"
    assert not store.delete(mine.id, b) and not store.delete(public.id, a)  # not theirs / shared
    assert store.delete(mine.id, a) and store.get(mine.id) is None
    assert store.delete(public.id)  # a scope that sees all owns all
    store.close()


def test_concurrent_creates_of_one_name_have_one_winner(store_url):
    """Eight stores (as eight servers would have) create one name at once: one wins, seven get the typed error."""
    open_voice_store(store_url).close()  # the table exists: this test is about the rows
    stores = [open_voice_store(store_url) for _ in range(8)]
    barrier = threading.Barrier(len(stores))

    def create(i: int):
        barrier.wait()
        try:
            return stores[i].create("race", "seed", seed=i)
        except VoiceConflictError as e:
            return e

    with concurrent.futures.ThreadPoolExecutor(len(stores)) as pool:
        results = list(pool.map(create, range(len(stores))))
    winners = [r for r in results if not isinstance(r, VoiceConflictError)]
    assert len(winners) == 1 and len(results) == 8, results
    assert [(r.id, r.seed) for r in stores[0].list()] == [(winners[0].id, winners[0].seed)]
    for s in stores:
        s.close()


# ---- PostgreSQL only -------------------------------------------------------------------------------------
def test_servers_starting_together_create_the_table_once(pg):
    """CREATE TABLE IF NOT EXISTS alone is not safe under concurrency in PostgreSQL (the loser fails on the
    catalog's unique index): eight stores opening an empty database at once must all succeed."""
    url = pg.create_database("empty")
    barrier, errors = threading.Barrier(8), []

    def open_one():
        barrier.wait()
        try:
            open_voice_store(url).close()
        except Exception as e:  # noqa: BLE001 - collected and shown by the assert
            errors.append(e)

    threads = [threading.Thread(target=open_one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []


def test_a_connection_dropped_while_idle_is_replaced(pg):
    store = open_voice_store(pg.create_database("dropped"))
    store.create("kept", "seed", seed=5)
    with pg.admin() as conn:  # what a database restart or an idle timeout does to the store's connections
        killed = conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (pg.role,)
        ).fetchall()
    assert killed and all(ok for (ok,) in killed)
    assert [r.name for r in store.list()] == ["kept"]
    store.close()


def test_statements_time_out_unless_the_url_sets_options(pg):
    url = pg.create_database("timeouts")
    store = open_voice_store(url)
    assert store._run(lambda conn: conn.execute("SHOW statement_timeout").fetchone()[0]) == "10s"
    store.close()
    sep = "&" if "?" in url else "?"
    store = open_voice_store(url + sep + "options=-c%20statement_timeout%3D3s")
    assert store._run(lambda conn: conn.execute("SHOW statement_timeout").fetchone()[0]) == "3s"
    store.close()


def test_a_role_without_create_rights_uses_an_existing_table(pg):
    """Since PostgreSQL 15 a plain role may not create tables in `public`: the store must not need to once
    the table exists (it checks before CREATE TABLE)."""
    owner_url = pg.create_database("granted")
    open_voice_store(owner_url).close()  # the owner creates the table
    with pg.admin("granted") as conn:
        conn.execute("CREATE ROLE tts_app LOGIN PASSWORD 'app-pw'")
        conn.execute("GRANT SELECT, INSERT, DELETE ON voices TO tts_app")
    store = open_voice_store(owner_url.replace(f"{pg.role}:", "tts_app:").replace(pg.password, "app-pw"))
    rec = store.create("limited", "seed", seed=9)
    assert [r.id for r in store.list()] == [rec.id] and store.delete(rec.id)
    store.close()


def test_an_unreachable_database_is_503_and_builtin_voices_still_work(pg, serve, caplog):
    url = pg.create_database("flaky")
    srv, _ = serve(voices_db=url)
    with srv.client() as c:
        assert c.post("/v1/audio/voices", json={"name": "mine", "seed": 3}).status_code == 200
        with pg.admin() as conn:  # the database goes away: new connections refused, open ones dropped
            conn.execute("ALTER DATABASE flaky ALLOW_CONNECTIONS false")
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = 'flaky'")
        for r in (c.get("/v1/audio/voices"), c.post("/v1/audio/speech", json={**SPEECH, "voice": "mine"})):
            assert r.status_code == 503 and r.json()["error"]["code"] == "voices_unavailable", r.text
            assert "flaky" not in r.text  # where the database is goes to the log, not to clients
        assert f"voices database {mask_url(url)}: " in caplog.text and pg.password not in caplog.text
        assert c.post("/v1/audio/speech", json={**SPEECH, "voice": "alloy"}).status_code == 200
        with pg.admin() as conn:
            conn.execute("ALTER DATABASE flaky ALLOW_CONNECTIONS true")
        assert [v["name"] for v in c.get("/v1/audio/voices").json()["data"] if v["type"] != "builtin"] == ["mine"]


# ---- two real servers on one database --------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_servers(pg, tmp_path_factory):
    """Servers A and B (one process each, the tiny model) with --voices-db naming one database."""
    url = pg.create_database("shared")
    tmp = tmp_path_factory.mktemp("pg-servers")
    servers = [ServeProcess(tmp, "--voices-db", url, count=0) for _ in range(2)]  # both load at once
    try:
        for srv in servers:
            srv.wait_ready()
        yield servers
    finally:
        for srv in servers:
            srv.stop()
    for srv in servers:  # the URL is logged, its password never
        assert pg.password not in srv.log() and f"voices database: {mask_url(url)}" in srv.log()


def _pcm(c: httpx.Client, voice) -> bytes:
    r = c.post("/v1/audio/speech", json={**SPEECH, "voice": voice})
    assert r.status_code == 200, r.text
    return r.content


def test_a_voice_saved_on_one_server_is_used_on_the_other(two_servers):
    a, b = (httpx.Client(base_url=srv.url, timeout=60) for srv in two_servers)
    with a, b:
        r = a.post("/v1/audio/voices", json={"name": "shared narrator", "seed": 77})
        assert r.status_code == 200, r.text
        voice = r.json()
        assert voice in b.get("/v1/audio/voices").json()["data"]
        assert b.get(f"/v1/audio/voices/{voice['id']}").json() == voice
        on_b = _pcm(b, "shared narrator")
        assert same_audio(on_b, _pcm(b, {"seed": 77})) and same_audio(on_b, _pcm(b, {"id": voice["id"]}))
        assert b.post("/v1/audio/voices", json={"name": "shared narrator", "seed": 1}).status_code == 409

        r = b.delete("/v1/audio/voices/shared narrator")
        assert r.status_code == 200 and r.json()["id"] == voice["id"], r.text
        assert voice["id"] not in {v["id"] for v in a.get("/v1/audio/voices").json()["data"]}
        r = a.post("/v1/audio/speech", json={**SPEECH, "voice": "shared narrator"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "voice_not_found"
        assert a.delete(f"/v1/audio/voices/{voice['id']}").status_code == 404


def test_concurrent_creates_over_two_servers_have_one_winner(two_servers):
    """Eight clients, four per server, create one name at once: exactly one 200, seven 409 voice_exists."""
    clients = [httpx.Client(base_url=two_servers[i % 2].url, timeout=60) for i in range(8)]
    barrier = threading.Barrier(len(clients))

    def create(i: int) -> httpx.Response:
        barrier.wait()
        return clients[i].post("/v1/audio/voices", json={"name": "contested", "seed": 100 + i})

    try:
        with concurrent.futures.ThreadPoolExecutor(len(clients)) as pool:
            responses = list(pool.map(create, range(len(clients))))
        codes = sorted(r.status_code for r in responses)
        assert codes == [200] + [409] * 7, [(r.status_code, r.text) for r in responses]
        assert all(r.json()["error"]["code"] == "voice_exists" for r in responses if r.status_code == 409)
        winner = next(r.json() for r in responses if r.status_code == 200)
        for c in clients[:2]:  # both servers list the one winner
            listed = [v for v in c.get("/v1/audio/voices").json()["data"] if v["name"] == "contested"]
            assert listed == [winner]
    finally:
        for c in clients:
            c.close()


# ---- a bad URL at start --------------------------------------------------------------------------------
def test_a_bad_url_is_one_line_and_exit_status_2(pg):
    """An unreachable server and a wrong password: each refused before the model loads, in one stderr line
    that names the problem and shows the URL with its password masked."""
    closed = free_port()
    refused = f'password authentication failed for user "{pg.role}"'
    cases = [
        (f"postgresql://{pg.role}:topsecret-1@127.0.0.1:{closed}/shared", "topsecret-1", "Connection refused"),
        (pg.url("shared", password="topsecret-2"), "topsecret-2", refused),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TTSSERVE_")} | {"PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "ttsserve.entrypoints.cli", "serve", *TINY_CLI_ARGS, "--voices-db", url],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for url, _, _ in cases
    ]
    for proc, (url, secret, reason) in zip(procs, cases):
        out, err = proc.communicate(timeout=120)
        lines = err.splitlines()
        assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, lines[-20:])
        assert lines[0].startswith(f"ttsserve serve: error: --voices-db {mask_url(url)}: "), lines[0]
        assert reason in lines[0] and "***" in lines[0], lines[0]
        assert secret not in out + err

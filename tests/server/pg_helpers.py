"""A real, throwaway PostgreSQL server for tests: initdb in a temporary folder, postgres on a free loopback
port with its unix socket in that folder, stopped and deleted at the end.

PostgreSQL refuses to run as root: as root (CI, containers) initdb and postgres run as the `postgres` system
user (made by Debian's postgresql package) through runuser, in a folder that user owns. Debian keeps the
binaries in /usr/lib/postgresql/<version>/bin, off PATH: that is searched too (newest version first).
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path
from urllib.parse import quote

from tests.server.multiproc_helpers import free_port

PG_USER = "postgres"  # the system user, and the superuser role initdb makes
BINARIES = ("initdb", "pg_ctl", "postgres")


def pg_bin_dir() -> Path | None:
    """The folder holding initdb, pg_ctl and postgres: on PATH, else Debian's newest versioned folder."""
    on_path = [shutil.which(b) for b in BINARIES]
    if all(on_path):
        return Path(os.path.realpath(on_path[0])).parent
    versioned = sorted(
        glob.glob("/usr/lib/postgresql/*/bin"), key=lambda d: [int(x) for x in d.split("/")[-2].split(".")]
    )
    for d in reversed(versioned):
        if all(os.access(os.path.join(d, b), os.X_OK) for b in BINARIES):
            return Path(d)
    return None


def unavailable_reason() -> str | None:
    """Why a PostgreSQL server cannot be started here (for pytest.skip), None if it can."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg is not installed (pip install 'psycopg[binary]', or scripts/ci_deps.sh)"
    if pg_bin_dir() is None:
        return "no PostgreSQL server binaries (initdb, pg_ctl, postgres) on PATH or in /usr/lib/postgresql/*/bin"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(PG_USER)
        except KeyError:
            return f"running as root and there is no {PG_USER!r} system user to run PostgreSQL as"
        if shutil.which("runuser") is None:
            return "running as root and runuser is missing (needed to run PostgreSQL as the postgres user)"
    return None


class PostgresServer:
    """start() -> a server with a login role `role` (password `password`, TCP with scram-sha-256 on 127.0.0.1)
    that owns the databases made by create_database; the superuser connects through the unix socket."""

    role = "ttsserve"
    password = "pw-S3cret.tts"

    def __init__(self) -> None:
        self.bin = pg_bin_dir()
        self.dir = Path(tempfile.mkdtemp(prefix="ttsserve-pg-"))
        self.data = self.dir / "data"
        self.port = free_port()
        self.as_root = os.geteuid() == 0

    def _run(self, *cmd: str) -> None:
        prefix = ["runuser", "-u", PG_USER, "--"] if self.as_root else []
        proc = subprocess.run([*prefix, *cmd], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}{proc.stderr}{self.log()}"

    def log(self) -> str:
        path = self.dir / "postgres.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def start(self) -> PostgresServer:
        if self.as_root:
            shutil.chown(self.dir, PG_USER, PG_USER)
        self._run(
            str(self.bin / "initdb"), "-D", str(self.data), "-U", PG_USER, "-E", "UTF8", "--locale=C", "--no-sync",
            "--auth-local=trust", "--auth-host=scram-sha-256",
        )  # fmt: skip
        options = (
            f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off -c synchronous_commit=off "
            "-c full_page_writes=off -c shared_buffers=16MB -c max_connections=60"
        )
        log = str(self.dir / "postgres.log")
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", log, "-o", options, "-w", "-t", "60", "start")
        with self.admin() as conn:
            conn.execute(f"CREATE ROLE {self.role} LOGIN PASSWORD '{self.password}'")
        return self

    def admin(self, dbname: str = "postgres"):
        """A superuser connection through the unix socket (autocommit)."""
        import psycopg

        return psycopg.connect(host=str(self.dir), port=self.port, user=PG_USER, dbname=dbname, autocommit=True)

    def create_database(self, name: str) -> str:
        """A new database owned by the login role; its URL (password included)."""
        with self.admin() as conn:
            conn.execute(f"CREATE DATABASE {name} OWNER {self.role}")
        return self.url(name)

    def url(self, dbname: str, password: str | None = None) -> str:
        secret = quote(self.password if password is None else password, safe="")
        return f"postgresql://{self.role}:{secret}@127.0.0.1:{self.port}/{dbname}"

    def stop(self) -> None:
        with contextlib.suppress(AssertionError, subprocess.TimeoutExpired):
            if (self.data / "postmaster.pid").exists():
                self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.dir, ignore_errors=True)

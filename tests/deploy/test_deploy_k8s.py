"""Static checks of the Kubernetes manifest deploy/k8s/ttsserve.yaml: every document validates against the
Kubernetes API schemas (kubernetes-validate, strict: an unknown or misspelled field fails), and the Deployment
keeps the promises docs/DEPLOY.md makes: the probes hit /ready and /health on the container's port, one GPU,
and a grace period longer than the drain the server is started with. No cluster runs in CI.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

kv = pytest.importorskip(
    "kubernetes_validate",
    reason="kubernetes-validate not installed (the `test` extra: pip install kubernetes-validate)",
)
import yaml  # noqa: E402  (a dependency of kubernetes-validate)

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "deploy/k8s/ttsserve.yaml"
# ServerConfig.drain_timeout_s's default, for a container that sets neither the flag nor the variable.
DEFAULT_DRAIN_S = 30.0
# The liveness probe must not kill a pod during a first start on a new GPU node (docs/DEPLOY.md, cold start).
COLD_START_S = 90


def _docs() -> list[dict]:
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]


def _validate(doc: dict) -> None:
    kv.validate(doc, kv.latest_version(), strict=True)


def _by_kind(kind: str) -> list[dict]:
    return [d for d in _docs() if d["kind"] == kind]


def _container() -> dict:
    (deploy,) = _by_kind("Deployment")
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    return container


def _flag(args: list[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag:
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _env(container: dict, name: str) -> str | None:
    return next((e.get("value") for e in container.get("env", []) if e["name"] == name), None)


def _probe_port(probe: dict, container: dict) -> int:
    port = probe["httpGet"]["port"]
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in container["ports"] if p.get("name") == port)


@pytest.mark.parametrize("index", range(len(_docs())), ids=lambda i: f"{_docs()[i]['kind']}-{i}")
def test_manifest_validates_strictly(index: int) -> None:
    _validate(_docs()[index])


def test_the_validator_rejects_a_misspelled_field() -> None:
    # The check above really runs in strict mode: one misspelled key in the pod spec fails.
    (deploy,) = _by_kind("Deployment")
    broken = copy.deepcopy(deploy)
    pod = broken["spec"]["template"]["spec"]
    pod["terminationGracePeriodSecond"] = pod.pop("terminationGracePeriodSeconds")
    with pytest.raises(kv.ValidationError):
        _validate(broken)


def test_deployment_and_service_are_there() -> None:
    (deploy,) = _by_kind("Deployment")
    (svc,) = _by_kind("Service")
    labels = deploy["spec"]["template"]["metadata"]["labels"]
    assert deploy["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert svc["spec"]["selector"].items() <= labels.items()
    container = _container()
    ports = {p.get("name"): p["containerPort"] for p in container["ports"]}
    for sp in svc["spec"]["ports"]:
        target = sp.get("targetPort", sp["port"])
        assert (ports.get(target) if isinstance(target, str) else target) in ports.values()


def test_serves_the_port_it_declares() -> None:
    container = _container()
    assert container["image"].startswith("ttsserve:gpu") or "/ttsserve:" in container["image"]
    port = int(_flag(container["args"], "--port") or _env(container, "TTSSERVE_PORT") or 8000)
    assert port in [p["containerPort"] for p in container["ports"]]
    assert _flag(container["args"], "--host") == "0.0.0.0", "the probes and the Service reach the pod IP"


def test_probes_hit_ready_and_health_on_the_container_port() -> None:
    container = _container()
    port = int(_flag(container["args"], "--port") or 8000)
    ready, live = container["readinessProbe"], container["livenessProbe"]
    assert ready["httpGet"]["path"] == "/ready"
    assert live["httpGet"]["path"] == "/health"
    assert _probe_port(ready, container) == port
    assert _probe_port(live, container) == port


def test_liveness_tolerates_a_cold_start() -> None:
    live = _container()["livenessProbe"]
    first_kill_s = live.get("initialDelaySeconds", 0) + live.get("periodSeconds", 10) * (
        live.get("failureThreshold", 3) - 1
    )
    assert first_kill_s > COLD_START_S, f"a pod still loading would be killed after {first_kill_s} s"


def test_one_gpu() -> None:
    resources = _container()["resources"]
    assert int(resources["limits"]["nvidia.com/gpu"]) == 1


def test_grace_period_covers_the_drain() -> None:
    (deploy,) = _by_kind("Deployment")
    pod = deploy["spec"]["template"]["spec"]
    container = _container()
    drain = _flag(container["args"], "--drain-timeout") or _env(container, "TTSSERVE_DRAIN_TIMEOUT_S")
    drain_s = float(drain) if drain is not None else DEFAULT_DRAIN_S
    assert pod["terminationGracePeriodSeconds"] > drain_s
    # The server drains on SIGTERM by itself; a preStop sleep would only delay that and eat the grace period.
    assert "preStop" not in container.get("lifecycle", {})

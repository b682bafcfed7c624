"""vLLM-compatible metrics on a live server (tiny model), and the shipped Grafana dashboard against them: every
metric name a panel's PromQL uses is one /metrics exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import wait_until
from ttsserve.engine.step_stats import REQUEST_LATENCY_BUCKETS_S
from ttsserve.server.vllm_metrics import TTFT_BUCKETS_S

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "ttsserve.json"
SPEECH = {"model": "tts-1", "input": "Metrics.", "voice": "alloy", "response_format": "pcm", "seed": 3}
# PromQL words that look like names: aggregation keywords, modifiers and the grouping clauses' label lists
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool", "and", "or", "unless"}


def promql_metric_names(expr: str) -> set[str]:
    """The metric names in a PromQL expression: identifiers that are not functions (followed by '('), label
    matchers ({...}), grouping labels (by (...)), ranges ([...]), strings or keywords."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = set()
    for m in re.finditer(r"(?<![\w:.$])([a-zA-Z_:][\w:]*)\s*(\()?", expr):
        if m.group(2) is None and m.group(1) not in _KEYWORDS:
            names.add(m.group(1))
    return names


def test_promql_metric_names():
    e = 'histogram_quantile(0.99, sum by (le) (rate(vllm:x_bucket{model_name="$m"}[$__rate_interval]))) / a_total'
    assert promql_metric_names(e) == {"vllm:x_bucket", "a_total"}


def _scrape_after_one_request(srv) -> str:
    """/metrics once the request's synthesis is settled (that runs when its response closes, after the client
    has the body)."""
    with srv.client() as c:
        assert c.post("/v1/audio/speech", json=SPEECH).status_code == 200
        assert wait_until(lambda: "vllm:request_success_total{" in c.get("/metrics").text)
        return c.get("/metrics").text


def _exported(text: str) -> dict[str, object]:
    """sample name -> its family (histograms give _bucket, _sum and _count samples)."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = fam
    return out


def test_vllm_names_types_and_buckets(serve_real):
    srv, _ = serve_real()
    text = _scrape_after_one_request(srv)
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    model = {"model_name": "chattts"}
    for name, kind in (
        ("vllm:num_requests_running", "gauge"),
        ("vllm:num_requests_waiting", "gauge"),
        ("vllm:kv_cache_usage_perc", "gauge"),
        ("vllm:time_to_first_token_seconds", "histogram"),
        ("vllm:e2e_request_latency_seconds", "histogram"),
        ("vllm:request_queue_time_seconds", "histogram"),
        ("vllm:request_success", "counter"),
    ):
        assert fams[name].type == kind, name
        assert all(s.labels.get("model_name") == "chattts" for s in fams[name].samples), name
    success = {s.labels["finished_reason"]: s.value for s in fams["vllm:request_success"].samples}
    assert success == {"stop": 1.0} or success == {"length": 1.0}, success
    for name, bounds in (
        ("vllm:time_to_first_token_seconds", TTFT_BUCKETS_S),
        ("vllm:e2e_request_latency_seconds", REQUEST_LATENCY_BUCKETS_S),
        ("vllm:request_queue_time_seconds", REQUEST_LATENCY_BUCKETS_S),
    ):
        samples = fams[name].samples
        les = [float(s.labels["le"]) for s in samples if s.name.endswith("_bucket")]
        assert les == [*bounds, float("inf")], name
        count = next(s.value for s in samples if s.name.endswith("_count") and s.labels.items() >= model.items())
        assert count == 1.0, name
    assert TTFT_BUCKETS_S[:3] == (0.001, 0.005, 0.01) and REQUEST_LATENCY_BUCKETS_S[-1] == 7680.0  # vLLM's layouts


def test_grafana_dashboard_queries_use_exported_metrics(serve_real):
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    # a variable's label_values(metric, label): its metric
    exprs += [re.sub(r",\s*\w+\)$", ")", v["definition"]) for v in dash["templating"]["list"] if v.get("definition")]
    assert len(exprs) >= 10
    srv, _ = serve_real()
    exported = _exported(_scrape_after_one_request(srv))
    used = set().union(*(promql_metric_names(e) for e in exprs))
    assert {"vllm:time_to_first_token_seconds_bucket", "vllm:kv_cache_usage_perc"} <= used
    assert not used - set(exported), f"the dashboard queries metrics /metrics does not export: {used - set(exported)}"
    for p in dash["panels"]:  # each panel filters the vLLM families by the dashboard's model
        for t in p["targets"]:
            if "vllm:" in t["expr"]:
                assert 'model_name="$model_name"' in t["expr"], t["expr"]

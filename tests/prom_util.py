"""Read one figure from a Prometheus text exposition, the way a dashboard would: the named sample summed over
the series whose labels include the given ones (so a per-core gauge reads as the server's total)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def metric(text: str, name: str, labels: str | dict | None = None, missing: float | None = None) -> float:
    """The sum of samples `name` whose labels include `labels` ({"le": "+Inf"} or '{le="+Inf"}'). A name with
    no such sample: `missing` if given, else AssertionError (a renamed metric must not read as 0)."""
    want = _labels(labels)
    found = [
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in want.items())
    ]
    if not found:
        assert missing is not None, f"{name}{labels or ''} missing"
        return missing
    return float(sum(found))


def _labels(labels: str | dict | None) -> dict:
    if labels is None or isinstance(labels, dict):
        return dict(labels or {})
    pairs = [p for p in labels.strip("{}").split(",") if p]
    return {k: v.strip('"') for k, v in (p.split("=", 1) for p in pairs)}

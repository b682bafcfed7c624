"""Corpus selection, result figures and the report writer (no model needed)."""

from __future__ import annotations

import json
import math

import pytest

from ttsserve.bench.corpus import load_corpus, select_texts
from ttsserve.bench.report import build_report, markdown, ratios, rewrite_report, write_report
from ttsserve.bench.results import FRAME_SECONDS, RequestRecord, RunResult, percentiles


def test_corpus_has_all_languages_and_lengths() -> None:
    corpus = load_corpus()
    assert 50 <= len(corpus) <= 80
    assert len({s.id for s in corpus}) == len(corpus)
    for lang in ("en", "zh", "mixed"):
        for length in ("short", "medium", "long"):
            assert any(s.lang == lang and s.length == length for s in corpus), (lang, length)
    # lengths mean something: every long text is longer than every short text of its language
    for lang in ("en", "zh", "mixed"):
        short = max(len(s.text) for s in corpus if s.lang == lang and s.length == "short")
        long = min(len(s.text) for s in corpus if s.lang == lang and s.length == "long")
        assert long > 2 * short, lang


def test_select_texts_is_seeded_filtered_and_cycles() -> None:
    a, b = select_texts(10, seed=3), select_texts(10, seed=3)
    assert [s.id for s in a] == [s.id for s in b]
    assert [s.id for s in select_texts(10, seed=4)] != [s.id for s in a]
    zh = select_texts(30, seed=0, langs=("zh",))
    assert all(s.lang == "zh" for s in zh)
    pool = {s.id for s in load_corpus() if s.lang == "zh"}
    assert len({s.id for s in zh[: len(pool)]}) == len(pool)  # no repeats before the pool is used up
    assert select_texts(0) == []
    with pytest.raises(ValueError, match="no corpus sentence"):
        select_texts(1, langs=("fr",))


def test_bad_corpus_line_names_the_line(tmp_path) -> None:
    p = tmp_path / "c.jsonl"
    p.write_text(
        '{"id": "a", "lang": "en", "length": "short", "text": "hi"}\n{"id": "b", "lang": "xx", '
        '"length": "short", "text": "x"}\n'
    )
    with pytest.raises(ValueError, match=r"c\.jsonl:2"):
        load_corpus(p)


def test_percentiles() -> None:
    p = percentiles([1.0, 2.0, 3.0, 4.0])
    assert p["p50"] == 2.5 and p["max"] == 4.0 and p["mean"] == 2.5
    assert math.isclose(p["p90"], 3.7) and math.isclose(p["p99"], 3.97)
    assert percentiles([])["p50"] is None


def _run(backend: str, load: int, frames: int, wall: float) -> RunResult:
    recs = [
        RequestRecord(
            f"{backend}-{i}",
            num_frames=frames,
            num_samples=512 * frames - 256,
            latency_s=wall * (i + 1) / load,
            ttfa_s=0.1 * (i + 1),
        )
        for i in range(load)
    ]
    recs.append(RequestRecord("bad", status="429"))
    return RunResult(
        backend, "offline", "batch_size", load, wall, recs, peak_memory_bytes=2**30, memory_kind="rss_peak_sampled"
    )


def test_summary_figures_are_consistent() -> None:
    s = _run("ttsserve", 4, 100, 2.0).summary()
    assert s["num_requests"] == 5 and s["num_ok"] == 4 and s["errors"] == {"429": 1}
    assert s["total_frames"] == 400 and s["frames_per_s"] == 200.0
    assert math.isclose(s["audio_seconds"], 4 * (512 * 100 - 256) / 24000)
    # frames/s * 512/24000 = audio-s/s up to the decoder edge of 256 samples per request
    assert math.isclose(s["frames_per_s"] * FRAME_SECONDS, s["audio_seconds_per_s"], rel_tol=1.01 * 256 / (512 * 100))
    assert s["latency_s"]["max"] == 2.0 and s["ttfa_s"]["p50"] == pytest.approx(0.25)


def test_report_files_ratios_and_strict_json(tmp_path) -> None:
    results = [
        _run("hf", 1, 10, 4.0),
        _run("ttsserve", 1, 10, 1.0),
        _run("hf", 8, 10, 8.0),
        _run("ttsserve", 8, 10, 2.0),
    ]
    results[0].requests[0].latency_s = math.nan  # must not break strict JSON
    r = ratios(results)
    assert [q["load"] for q in r] == [1, 8]
    assert r[1]["throughput_ratio"] == pytest.approx(4.0) and r[1]["latency_p50_speedup"] == pytest.approx(4.0)
    report = build_report("offline", results, {"spec": {"frames": 10}}, {"command": "x", "cpu_cores": 2})
    out = write_report(report, results, tmp_path / "r")
    data = json.loads((out / "report.json").read_text())
    assert data["kind"] == "offline" and len(data["results"]) == 4 and data["ratios"]
    assert data["results"][0]["requests"][0]["latency_s"] is None
    for name in ("throughput.png", "latency.png", "ttfa_cdf.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "report.md").read_text()
    assert "| hf | 8 |" in md and "ttsserve vs hf" in md
    assert markdown(report, results) == md
    # report.json holds everything: re-rendering from it gives the same Markdown
    (out / "report.md").unlink()
    (out / "throughput.png").unlink()
    rewrite_report(out)
    assert (out / "report.md").read_text() == md and (out / "throughput.png").exists()

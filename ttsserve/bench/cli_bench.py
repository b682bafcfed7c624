"""`ttsserve bench offline | serve`: argument parsing and the glue from flags to runs and reports.

Mounted by ttsserve/entrypoints/cli.py through add_bench_parser(subparsers); each sub-command sets `func(args) -> int`.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import os
import sys
from collections.abc import Callable, Iterable

from ttsserve.constants import MODEL_NAME
from ttsserve.engine.args import ENGINE_FIELDS_DEST, add_engine_args, add_model_args, engine_kwargs
from ttsserve.engine.core.heap import frozen_heap

logger = logging.getLogger(__name__)


def _ints(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


def _floats(s: str) -> list[float]:
    try:
        return [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}") from None


def _words(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=0, help="picks the texts and the per-request sampling seeds")
    p.add_argument("--langs", type=_words, default=["en", "zh", "mixed"], help="corpus languages, e.g. en,zh")
    p.add_argument(
        "--text-lengths",
        type=_words,
        default=["short", "medium", "long"],
        help="corpus sentence lengths, e.g. short,medium",
    )
    p.add_argument("--out", default=None, help="report folder (default benchmarks/results/<timestamp>-<kind>/)")
    p.add_argument("--no-plots", action="store_true", help="write report.md and report.json only, no PNG plots")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")


def _add_offline(sub) -> None:
    p = sub.add_parser("offline", help="drive the engine (and/or the HF baseline) directly, no HTTP")
    p.add_argument(
        "--backend",
        default="ttsserve",
        choices=["ttsserve", "hf", "both"],
        help="what to measure: ttsserve, the HF baseline (the reference implementation's loop), or both",
    )
    p.add_argument("--batch-sizes", type=_ints, default=[1, 8, 32], help="requests submitted at once, e.g. 1,8,32")
    p.add_argument("--frames", type=int, default=128, help="frames per segment (the cap, for --lengths natural)")
    p.add_argument(
        "--lengths",
        default="fixed",
        choices=["fixed", "natural"],
        help="fixed: min_new_tokens = max_new_tokens = frames; natural: stop at EOS",
    )
    p.add_argument("--rounds", type=int, default=1, help="batches per batch size")
    p.add_argument("--split", action="store_true", help="split long texts into segments (default: one each)")
    p.add_argument(
        "--warmup-frames",
        type=int,
        default=8,
        help="before each batch size, an untimed batch of that size with this many frames (0: none)",
    )
    p.add_argument("--greedy", action="store_true", help="argmax sampling (deterministic codes) instead of top-p/top-k")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU intra-op threads (default: $OMP_NUM_THREADS, else the physical cores)",
    )
    add_model_args(
        p,
        helps={
            "quantization": "GPT weight format (a dense dummy checkpoint is quantized at load; "
            "the hf backend always runs dense weights)"
        },
    )
    # --seed picks the texts (and seeds the dummy weights); --threads is cpu_threads
    add_engine_args(p, exclude=("seed", "cpu_threads"))
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="any EngineConfig field, e.g. lookahead_frames=8 (repeatable; overrides the flags)",
    )
    _add_common(p)
    p.set_defaults(func=cmd_offline)


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="HTTP load test against a running `ttsserve serve`")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (loopback only by default)")
    p.add_argument("--allow-remote", action="store_true", help="allow a non-loopback --url")
    p.add_argument(
        "--endpoint",
        default="speech",
        choices=["speech", "synthesize"],
        help="speech: POST /v1/audio/speech (OpenAI); synthesize: POST /synthesize",
    )
    p.add_argument("--model-name", default=MODEL_NAME, help="the body's `model` field")
    p.add_argument("--voice", default="alloy", help="the body's `voice` field (a built-in or saved voice)")
    p.add_argument("--concurrency", type=_ints, default=[], help="closed-loop clients per point, e.g. 1,4,16")
    p.add_argument("--qps", type=_floats, default=[], help="Poisson arrival rates per point, e.g. 0.5,2")
    p.add_argument("--num-requests", type=int, default=32, help="requests per point (at most)")
    p.add_argument("--duration", type=float, default=120.0, help="seconds per point (at most; no new sends after)")
    p.add_argument(
        "--warmup-s",
        type=float,
        default=0.0,
        help="also report the TTFA of the requests sent after this many seconds (every figure still counts "
        "every request): a closed loop starts every stream at once, and their ends start the next wave together",
    )
    p.add_argument("--no-stream", action="store_true", help="time whole responses, not chunks")
    p.add_argument(
        "--response-format",
        default="pcm",
        choices=["pcm", "mp3"],
        help="pcm: samples = bytes / 2; mp3: samples counted from the frame headers (encoding cost shows)",
    )
    p.add_argument("--max-new-tokens", type=int, default=256, help="frame cap per segment sent with each request")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    p.add_argument(
        "--client-procs",
        type=int,
        default=None,
        help="load-generator processes (default: one per 32 closed-loop streams or 50 req/s, at most half "
        "the cores; one Python client stops keeping up before the server does; the report's "
        "client CPU column shows each process's load and any stall of its event loop)",
    )
    _add_common(p)
    p.set_defaults(func=cmd_serve)


def add_bench_parser(subparsers, extra: Iterable[Callable] = ()) -> argparse.ArgumentParser:
    """Add `bench` with sub-commands `offline`, `serve`, `report`, plus each of `extra` (a function mounting a
    sub-command on bench's subparsers: the entry point adds tools/quant's `quality`); each sets
    func(args) -> exit code."""
    p = subparsers.add_parser("bench", help="offline and serving benchmarks with JSON/Markdown/PNG reports")
    sub = p.add_subparsers(dest="bench_command", required=True)
    _add_offline(sub)
    _add_serve(sub)
    r = sub.add_parser("report", help="re-render report.md and the plots from a report folder's report.json")
    r.add_argument("dir")
    r.add_argument("--no-plots", action="store_true", help="re-render report.md only, no PNG plots")
    r.set_defaults(func=cmd_report)
    for add in extra:
        add(sub)
    return p


# ---- commands ---------------------------------------------------------------------------------------------
def engine_overrides(items: list[str]) -> dict:
    """["field=value", ...] -> {field: typed value} for EngineConfig (ValueError naming a bad item)."""
    from ttsserve.config import EngineConfig

    types = {f.name: str(f.type) for f in dataclasses.fields(EngineConfig)}
    out = {}
    for item in items:
        name, sep, raw = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in types:
            raise ValueError(f"--engine-arg {item!r}: expected FIELD=VALUE with an EngineConfig field")
        kind = types[name]
        try:
            if raw.lower() == "none" and "None" in kind:
                value = None
            elif "bool" in kind:
                value = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}[raw.lower()]
            elif "int" in kind:
                value = int(raw)
            elif "float" in kind:
                value = float(raw)
            else:
                value = raw
        except (KeyError, ValueError):
            raise ValueError(f"--engine-arg {item!r}: {raw!r} is not a valid {kind}") from None
        out[name] = value
    return out


def _engine_config(a: argparse.Namespace):
    from ttsserve.config import EngineConfig

    fields = engine_kwargs(a) | dict(seed=a.seed, cpu_threads=a.threads)
    return EngineConfig(**(fields | engine_overrides(a.engine_arg)))


def _make_backend(name: str, cfg):
    if name == "hf":
        from ttsserve.bench.baseline_hf import HFBaseline

        return HFBaseline(cfg)
    from ttsserve.bench.offline import TTSServeBackend

    return TTSServeBackend(cfg)


def cmd_offline(a: argparse.Namespace) -> int:
    try:
        return _offline(a)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _offline(a: argparse.Namespace) -> int:
    import torch

    from ttsserve.bench.offline import OfflineSpec, run_offline
    from ttsserve.bench.report import build_report, default_out_dir, write_report
    from ttsserve.bench.sysinfo import machine_info

    if a.device == "cpu" or (a.device == "auto" and not torch.cuda.is_available()):
        from ttsserve.runner.cpu_threads import configure_cpu_threads

        configure_cpu_threads(a.threads)  # the same policy for both backends (the Engine applies it again)
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    spec = OfflineSpec(
        batch_sizes=a.batch_sizes,
        frames=a.frames,
        lengths=a.lengths,
        rounds=a.rounds,
        seed=a.seed,
        langs=a.langs,
        text_lengths=a.text_lengths,
        split=a.split,
        warmup_frames=a.warmup_frames,
        greedy=a.greedy,
    )
    cfg = _engine_config(a)
    names = ["hf", "ttsserve"] if a.backend == "both" else [a.backend]
    results, described, device = [], {}, None
    for name in names:
        backend = _make_backend(name, cfg)
        described[name], device = backend.describe(), str(backend.device)
        # the heap as the serving processes hold it (engine/core/heap.py): what start-up left (~216,000 objects on
        # an H100 host) frozen, so the full GC passes a round's allocations trigger do not walk it
        with frozen_heap() as frozen:
            logger.info("%s: %d start-up objects frozen for the rounds", name, frozen)
            results += run_offline(spec, backend, progress=not a.no_progress)
        del backend  # free one backend's weights and caches before the next one's peak is measured
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    config = {"spec": _plain(dataclasses.asdict(spec)), "engine": _plain(dataclasses.asdict(cfg)), "args": _args(a)}
    machine = machine_info(device) | {"load_average_1m_before": load_before}
    report = build_report("offline", results, config, machine, described)
    out = write_report(report, results, a.out or default_out_dir("offline"), plots=not a.no_plots)
    print((out / "report.md").read_text())
    print(f"report written to {out}")
    return 0


def cmd_serve(a: argparse.Namespace) -> int:
    from ttsserve.bench.report import build_report, default_out_dir, write_report
    from ttsserve.bench.serving import ServeSpec, run_serving
    from ttsserve.bench.sysinfo import machine_info

    try:
        spec = ServeSpec(
            url=a.url,
            endpoint=a.endpoint,
            model=a.model_name,
            voice=a.voice,
            concurrency=a.concurrency,
            qps=a.qps,
            num_requests=a.num_requests,
            duration=a.duration,
            stream=not a.no_stream,
            max_new_tokens=a.max_new_tokens,
            seed=a.seed,
            langs=a.langs,
            text_lengths=a.text_lengths,
            timeout=a.timeout,
            allow_remote=a.allow_remote,
            response_format=a.response_format,
            client_procs=a.client_procs,
            warmup_s=a.warmup_s,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    results = run_serving(spec, progress=not a.no_progress)
    machine = machine_info(None) | {"device": f"server at {a.url}"}
    report = build_report("serve", results, {"spec": _plain(dataclasses.asdict(spec)), "args": _args(a)}, machine)
    out = write_report(report, results, a.out or default_out_dir("serve"), plots=not a.no_plots)
    print((out / "report.md").read_text())
    print(f"report written to {out}")
    return 0


def cmd_report(a: argparse.Namespace) -> int:
    from ttsserve.bench.report import rewrite_report

    out = rewrite_report(a.dir, plots=not a.no_plots)
    print((out / "report.md").read_text())
    return 0


def _args(a: argparse.Namespace) -> dict:
    """The parsed flags (the report's `machine.command` is sys.argv, exact when run from the CLI)."""
    return {k: v for k, v in vars(a).items() if k not in ("func", ENGINE_FIELDS_DEST)}


def _plain(d: dict) -> dict:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()}

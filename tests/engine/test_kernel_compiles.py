"""The process's Triton compile counter (runner/kernel_compiles.py): its hooks chained into Triton's knobs, the
warning for a compile while serving, and an engine step that held one naming it in the slow-step line. Triton
itself is replaced by a stand-in module here; tests/gpu/test_kernel_compiles_gpu.py runs the real JIT."""

from __future__ import annotations

import logging
import sys
import time
import types

from engine_testutil import make_engine

from ttsserve.engine.step_stats import EngineCounters
from ttsserve.params import SamplingParams, SynthesisRequest
from ttsserve.runner import kernel_compiles as kc_mod
from ttsserve.runner.kernel_compiles import KernelCompiles

HOOK_KW = {"key": "k", "repr": "toy_kernel[num_warps=4](n: i32)", "fn": None, "compile": {}, "is_manual_warmup": False}


def fake_triton(monkeypatch, prior_cache_hook=None, prior_post_hook=None):
    """A `triton` module whose knobs.runtime holds the two JIT hooks, as Triton 3.4+ has."""
    runtime = types.SimpleNamespace(jit_cache_hook=prior_cache_hook, jit_post_compile_hook=prior_post_hook)
    mod = types.ModuleType("triton")
    mod.knobs = types.SimpleNamespace(runtime=runtime)
    monkeypatch.setitem(sys.modules, "triton", mod)
    return runtime


def compile_once(runtime, seconds: float = 0.0, repr_: str = HOOK_KW["repr"]):
    """What Triton's JIT does around one compile: the cache hook (a truthy answer skips the compile), then the
    post-compile hook. Returns the cache hook's answer."""
    skip = runtime.jit_cache_hook(**{**HOOK_KW, "repr": repr_})
    time.sleep(seconds)
    runtime.jit_post_compile_hook(**{**HOOK_KW, "repr": repr_})
    return skip


def test_hooks_count_and_time_each_compile_and_chain_the_hooks_already_set(monkeypatch):
    seen = []
    runtime = fake_triton(
        monkeypatch,
        lambda **kw: seen.append(("cache", kw["key"])) or True,
        lambda **kw: seen.append(("post", kw["repr"])),
    )
    kc = KernelCompiles()
    kc_mod._install(kc)
    assert compile_once(runtime, 0.02) is True  # the earlier hook's answer (skip the compile) is kept
    compile_once(runtime)
    assert kc.count == 2 and 0.02 <= kc.seconds < 1.0
    assert seen == [("cache", "k"), ("post", HOOK_KW["repr"])] * 2


def test_a_compile_while_serving_is_a_warning_naming_the_kernel(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="ttsserve.runner.model_runner")
    runtime = fake_triton(monkeypatch)
    kc = KernelCompiles()
    kc_mod._install(kc)
    compile_once(runtime)  # start-up: counted, not warned about
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    kc.serving = True
    compile_once(runtime, 0.01, "paged_decode_kernel[num_warps=4](num_splits: constexpr[1])")
    (rec,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    msg = rec.getMessage()
    assert "while serving" in msg and "paged_decode_kernel[num_warps=4](num_splits: constexpr[1])" in msg
    assert kc.count == 2 and kc.while_serving == 1


def test_without_triton_nothing_is_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    kc = KernelCompiles()
    kc_mod._install(kc)
    assert kc.count == 0 and kc.seconds == 0.0


def test_the_slow_step_line_names_the_compile_time_inside_it(caplog):
    caplog.set_level(logging.INFO, logger="ttsserve.engine.engine")
    c = EngineCounters()
    for _ in range(30):
        c.observe_step(10.0, {"runner_ms": 0.01}, rows=8, tokens=8, gc_ms=0.0)
    c.observe_step(520.0, {"runner_ms": 0.516}, rows=130, tokens=517, gc_ms=0.0, compile_ms=506.0)
    (rec,) = caplog.records
    assert "Triton compiles 506.0 ms" in rec.getMessage()


def test_a_step_holding_a_compile_is_logged_within_the_slow_step_interval(caplog):
    """Slow steps are logged once per interval, but one that waited for a compile always is: a slower step just
    before it must not hide the stall's cause."""
    caplog.set_level(logging.INFO, logger="ttsserve.engine.engine")
    c = EngineCounters()
    for _ in range(30):
        c.observe_step(10.0, {"runner_ms": 0.01}, rows=8, tokens=8, gc_ms=0.0)
    c.observe_step(90.0, {"runner_ms": 0.09}, rows=8, tokens=8, gc_ms=0.0)  # logged: the interval starts
    c.observe_step(160.0, {"runner_ms": 0.16}, rows=8, tokens=8, gc_ms=0.0, compile_ms=150.0)
    c.observe_step(200.0, {"runner_ms": 0.2}, rows=8, tokens=8, gc_ms=0.0)  # within the interval: counted only
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 2 and "Triton compiles" not in msgs[0] and "Triton compiles 150.0 ms" in msgs[1]
    assert c.slow_steps == 3


def test_an_engine_step_holding_a_compile_reports_it(tiny_model, monkeypatch, caplog):
    """Wired end to end: a compile inside a served step (simulated: the hooks' calls around a 150-ms pause in
    the audio phase) is a warning and shows in that step's slow-step line."""
    runtime = fake_triton(monkeypatch)
    kc = KernelCompiles()
    kc_mod._install(kc)
    monkeypatch.setattr(kc_mod, "_COMPILES", kc)
    e = make_engine(tiny_model)
    assert e._compiles is kc and kc.serving  # set once the engine is built
    caplog.set_level(logging.INFO)
    step, calls = e.audio.step, [0]

    def audio_step_with_a_compile():
        calls[0] += 1
        if calls[0] == 26:
            compile_once(runtime, 0.15, "toy_kernel[num_warps=4](n: constexpr[1])")
        return step()

    e.audio.step = audio_step_with_a_compile
    p = SamplingParams(seed=1, min_new_tokens=40, max_new_tokens=40)
    e.add_synthesis(SynthesisRequest("hello world", code_params=p, raw_text=True))
    while e.has_unfinished():
        e.step()
    msgs = [r.getMessage() for r in caplog.records]
    assert any("while serving" in m and "toy_kernel" in m for m in msgs)
    # the step that held it (150 ms and up) says so; on a busy machine other steps may be slow lines too
    slow = [m for m in msgs if m.startswith("slow engine step") and "Triton compiles" in m]
    assert len(slow) == 1 and "Triton compiles 1" in slow[0]
    assert e.stats()["kernel_compiles_while_serving_total"] == 1  # /metrics' counter


def test_describe_names_the_constexprs_the_16_divisible_ints_and_the_unaligned_pointers():
    """The hook's arguments as Triton 3.6 passes them: signature name -> type, constexpr values by argument
    path (an integer equal to 1 is one), the specialisation attributes by path ([] where none)."""
    sig = {"out_ptr": "*bf16", "x_ptr": "*fp32", "n": "i32", "splits": "constexpr", "BLOCK": "constexpr"}
    compile_ = {
        "signature": sig,
        "constants": {(3,): 1, (4,): 64},
        "configs": [{(0,): [["tt.divisibility", 16]], (1,): [], (2,): [["tt.divisibility", 16]]}],
    }
    fn = types.SimpleNamespace(name="toy_kernel")
    got = kc_mod.describe({"compile": compile_, "fn": fn, "repr": "unused"})
    assert got == "toy_kernel(splits=1, BLOCK=64; ints divisible by 16: ['n']; pointers not 16-byte aligned: ['x_ptr'])"
    assert kc_mod.describe({"compile": {}, "repr": "toy_kernel[...]"}) == "toy_kernel[...]"  # another layout


def test_the_hooks_are_installed_once_and_not_for_a_cpu_engine(monkeypatch):
    installs = []
    monkeypatch.setattr(kc_mod, "_COMPILES", None)
    monkeypatch.setattr(kc_mod, "_install", installs.append)
    kc = kc_mod.kernel_compiles(install=False)  # a CPU engine: Triton is not even imported
    assert installs == [] and not kc.installed
    assert kc_mod.kernel_compiles() is kc and kc_mod.kernel_compiles() is kc
    assert installs == [kc] and kc.installed

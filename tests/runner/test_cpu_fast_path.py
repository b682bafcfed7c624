"""The CPU fast path: the paged decode attention (index_select gather, reused scratch, fp32 math over a bf16
cache, per-step cached block ids / mask) against float64 attention, and the CPU thread policy."""

from __future__ import annotations

import random

import pytest
import torch

from ttsserve.attention.backend import kv_cache_shape
from ttsserve.attention.torch_ref import TorchPagedAttention, gather_kv, make_metadata, write_kv
from ttsserve.config import COMPILE_ENV
from ttsserve.runner import cpu_threads
from ttsserve.runner.cpu_threads import (
    cgroup_cpu_quota,
    configure_cpu_threads,
    openmp_env_defaults,
    physical_cores,
    plan_cpu_threads,
)


def attention_f64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One query per head over a whole context: q [Hq, D], k / v [L, Hkv, D] -> [Hq, D] in float64."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("hd,lhd->hl", q, k) / q.shape[-1] ** 0.5
    return torch.einsum("hl,lhd->hd", scores.softmax(-1), v)


def _decode_case(lens: list[int], hq: int, hkv: int, block_size: int, dtype: torch.dtype, seed: int):
    """A cache holding len-1 tokens of each sequence (shuffled blocks) and the step that adds the last one.
    Returns (cache, md, q, k, v, contexts) with contexts[i] = (k_i, v_i) of all len_i tokens."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    d = 8
    blocks_each = [-(-n // block_size) for n in lens]
    pool = list(range(sum(blocks_each) + 3))
    rng.shuffle(pool)
    tables, at = [], 0
    for nb in blocks_each:
        tables.append(pool[at : at + nb])
        at += nb
    cache = torch.zeros(kv_cache_shape(len(pool), block_size, hkv, d), dtype=dtype)
    contexts = [
        (torch.randn(n, hkv, d, generator=g).to(dtype), torch.randn(n, hkv, d, generator=g).to(dtype)) for n in lens
    ]
    history = make_metadata(tables, [0] * len(lens), [n - 1 for n in lens], block_size)
    write_kv(
        cache, torch.cat([k[:-1] for k, _ in contexts]), torch.cat([v[:-1] for _, v in contexts]), history.slot_mapping
    )
    md = make_metadata(tables, [n - 1 for n in lens], [1] * len(lens), block_size)
    q = torch.randn(len(lens), hq, d, generator=g).to(dtype)
    k = torch.stack([c[0][-1] for c in contexts])
    v = torch.stack([c[1][-1] for c in contexts])
    return cache, md, q, k, v, contexts


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
@pytest.mark.parametrize(
    "lens,heads,block_size",
    [
        ([37], (4, 4), 16),  # one sequence: no mask (eager), the gather is trimmed to the context
        ([20, 20, 20], (4, 4), 4),  # equal lengths: no mask either
        ([5, 33, 17, 1], (4, 2), 8),  # ragged lengths (mask), GQA, a one-token context
    ],
)
def test_decode_matches_float64(lens: list[int], heads: tuple[int, int], block_size: int, compiled: bool) -> None:
    cache, md, q, k, v, contexts = _decode_case(lens, *heads, block_size, torch.float32, seed=len(lens))
    assert md.is_decode_only
    backend = TorchPagedAttention(compile_decode=compiled)
    out = backend.forward(q, k, v, cache, md, q.shape[-1] ** -0.5)
    assert backend.compile_decode == compiled  # the compiled path really ran (no silent fallback)
    assert out.shape == q.shape and out.dtype == q.dtype
    for i, (kc, vc) in enumerate(contexts):
        assert (out[i].double() - attention_f64(q[i], kc, vc)).abs().max() < 1e-5


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
def test_bf16_cache_attends_in_fp32(compiled: bool) -> None:
    """A bf16 cache: the result is the float64 attention of the bf16 values to fp32 accuracy, then rounded
    once to bf16 (no bf16 rounding inside the softmax or the weighted sum)."""
    cache, md, q, k, v, contexts = _decode_case([40, 9, 26], 4, 4, 16, torch.bfloat16, seed=7)
    out = TorchPagedAttention(compile_decode=compiled).forward(q, k, v, cache, md, q.shape[-1] ** -0.5)
    assert out.dtype == torch.bfloat16
    for i, (kc, vc) in enumerate(contexts):
        want = attention_f64(q[i], kc, vc)
        # within one bf16 rounding (half an ulp: 2**-8 relative) of the exact value
        assert ((out[i].double() - want).abs() <= want.abs() * 2**-8 + 1e-6).all()


def test_scratch_reuse_and_per_step_cache() -> None:
    """One eager backend instance across steps of different shapes (the scratch grows and is reused; the
    cached page ids / mask belong to one metadata object) gives what fresh instances give, and the compiled
    kernel agrees with it."""
    backend = TorchPagedAttention(compile_decode=False)
    for seed, lens in enumerate([[50, 3], [2], [64, 64, 10, 33], [7, 7]]):
        cache, md, q, k, v, _ = _decode_case(lens, 2, 2, 4, torch.float32, seed=seed)
        got = backend.forward(q, k, v, cache, md, 0.5)
        again = backend.forward(q, k, v, cache, md, 0.5)  # same md object: cached ids / mask reused
        fresh = TorchPagedAttention(compile_decode=False).forward(q, k, v, cache.clone(), md, 0.5)
        assert torch.equal(got, fresh) and torch.equal(again, fresh)
        compiled = TorchPagedAttention(compile_decode=True).forward(q, k, v, cache.clone(), md, 0.5)
        assert (compiled - fresh).abs().max() < 1e-5


def test_compile_failure_falls_back_to_eager(monkeypatch) -> None:
    import ttsserve.attention.torch_ref as ref

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(ref, "_compiled_paged_decode", lambda: broken)
    cache, md, q, k, v, contexts = _decode_case([12, 30], 2, 2, 4, torch.float32, seed=3)
    backend = TorchPagedAttention(compile_decode=True)
    out = backend.forward(q, k, v, cache, md, q.shape[-1] ** -0.5)
    assert backend.compile_decode is False  # off for good after the first failure
    for i, (kc, vc) in enumerate(contexts):
        assert (out[i].double() - attention_f64(q[i], kc, vc)).abs().max() < 1e-5
    monkeypatch.delenv(COMPILE_ENV, raising=False)
    assert TorchPagedAttention().compile_decode is False  # opt-in
    monkeypatch.setenv(COMPILE_ENV, "1")
    assert TorchPagedAttention().compile_decode is True
    assert TorchPagedAttention(compile_decode=False).compile_decode is False  # an explicit choice wins


def test_warmup_compiles_without_touching_the_cache() -> None:
    cache = torch.randn(kv_cache_shape(3, 4, 2, 8)).to(torch.bfloat16)
    before = cache.clone()
    backend = TorchPagedAttention(compile_decode=True)
    backend.warmup(cache, num_heads=2)
    assert backend.compile_decode and torch.equal(cache, before)


def test_gather_kv_and_write_kv_roundtrip() -> None:
    cache = torch.zeros(kv_cache_shape(6, 4, 2, 3))
    table = [4, 1, 5]
    md = make_metadata([table], [0], [10], 4)
    k, v = torch.randn(10, 2, 3), torch.randn(10, 2, 3)
    write_kv(cache, k, v, md.slot_mapping)
    kb, vb = gather_kv(cache, md.block_tables[0], 10)
    assert torch.equal(kb, k) and torch.equal(vb, v)
    assert cache[:, [0, 2, 3]].eq(0).all() and cache[:, 5, 2:].eq(0).all()  # nothing else written


# ---- thread policy -----------------------------------------------------------------------------------
def _fake_topology(root, cpus: dict[int, tuple[int, int]]) -> None:
    for cpu, (package, core) in cpus.items():
        topo = root / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text(f"{package}\n")
        (topo / "core_id").write_text(f"{core}\n")


def test_physical_cores_counts_smt_siblings_once(tmp_path) -> None:
    # 2 packages x 2 cores x 2 SMT threads; logical CPUs 0-7
    _fake_topology(tmp_path, {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1), 4: (0, 0), 5: (0, 1), 6: (1, 0), 7: (1, 1)})
    assert physical_cores(set(range(8)), tmp_path) == 4
    assert physical_cores({0, 4}, tmp_path) == 1  # two siblings of one core
    assert physical_cores({0, 1, 2}, tmp_path) == 3
    assert physical_cores({9}, tmp_path) == 1  # no topology: a logical CPU counts as a core


def test_cgroup_quota(tmp_path) -> None:
    f = tmp_path / "cpu.max"
    f.write_text("150000 100000\n")
    assert cgroup_cpu_quota(f) == 1.5
    f.write_text("max 100000\n")
    assert cgroup_cpu_quota(f) is None
    assert cgroup_cpu_quota(tmp_path / "missing") is None


def test_plan_precedence_and_validation() -> None:
    assert plan_cpu_threads(3, {"OMP_NUM_THREADS": "5"}, cores=8, quota=None).intra_op_threads == 3
    p = plan_cpu_threads(None, {"OMP_NUM_THREADS": "5"}, cores=8, quota=2.0)
    assert (p.intra_op_threads, p.source, p.inter_op_threads) == (5, "OMP_NUM_THREADS", 1)
    p = plan_cpu_threads(None, {}, cores=8, quota=None)
    assert (p.intra_op_threads, p.source) == (8, "physical cores")
    assert plan_cpu_threads(None, {}, cores=8, quota=2.5).intra_op_threads == 3  # quota caps, rounded up
    assert plan_cpu_threads(None, {}, cores=2, quota=16.0).intra_op_threads == 2
    assert plan_cpu_threads(None, {}, cores=4, quota=0.2).intra_op_threads == 1
    for bad in ("0", "-2", "two"):
        with pytest.raises(ValueError, match="OMP_NUM_THREADS"):
            plan_cpu_threads(None, {"OMP_NUM_THREADS": bad}, cores=2, quota=None)
    with pytest.raises(ValueError, match="num_threads"):
        plan_cpu_threads(0, {}, cores=2, quota=None)
    assert "1 inter-op" in plan_cpu_threads(None, {}, cores=2, quota=None).describe()


def test_openmp_env_defaults_never_override() -> None:
    for mine in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"OMP_WAIT_POLICY": "PASSIVE"}, {"GOMP_SPINCOUNT": "0"}):
        env = dict(mine)
        assert openmp_env_defaults(env, on_cpu=True) == {} and env == mine  # a user's wait setting: none of ours
    env = {}
    assert openmp_env_defaults(env, on_cpu=True) == cpu_threads.OPENMP_ENV_DEFAULTS == env
    assert int(env["GOMP_SPINCOUNT"]) > 0  # a bounded spin, not PASSIVE (0) nor libgomp's default (300000)
    env = {}
    assert openmp_env_defaults(env, on_cpu=False) == {"OMP_WAIT_POLICY": "PASSIVE"} == env


def test_runs_on_cpu_is_decided_without_torch() -> None:
    assert cpu_threads.runs_on_cpu(["serve", "--device", "cpu"], {})
    assert cpu_threads.runs_on_cpu(["serve", "--device=cpu"], {"CUDA_VISIBLE_DEVICES": "0"})
    assert not cpu_threads.runs_on_cpu(["serve", "--device", "cuda:1"], {})
    assert cpu_threads.runs_on_cpu(["serve"], {"TTSSERVE_DEVICE": "cpu"})
    assert cpu_threads.runs_on_cpu(["serve"], {"CUDA_VISIBLE_DEVICES": ""})


def test_configure_applies_to_torch(monkeypatch) -> None:
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        assert configure_cpu_threads(1).intra_op_threads == 1 and torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        policy = configure_cpu_threads()
        assert policy.source == "OMP_NUM_THREADS" and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_background_warmup_serves_eagerly_until_the_compile_is_done(monkeypatch) -> None:
    import threading

    import ttsserve.attention.torch_ref as ref

    release, calls = threading.Event(), []

    def slow_compiled(q, k_pages, v_pages, tables, seq_lens, scale):  # a compiler that takes its time
        calls.append(threading.current_thread().name)
        release.wait(10)
        return ref.paged_decode_attention(q, k_pages, v_pages, tables, seq_lens, scale)

    monkeypatch.setattr(ref, "_compiled_paged_decode", lambda: slow_compiled)
    cache, md, q, k, v, contexts = _decode_case([12, 30], 2, 2, 4, torch.float32, seed=5)
    backend = TorchPagedAttention(compile_decode=True)
    backend.warmup(cache.clone(), num_heads=2, background=True)
    out = backend.forward(q, k, v, cache, md, q.shape[-1] ** -0.5)  # returns while the compile is stuck
    assert threading.current_thread().name not in calls
    release.set()
    assert backend._compiled_ready.wait(10) and backend.compile_decode
    out2 = backend.forward(q, k, v, cache, md, q.shape[-1] ** -0.5)
    assert calls[-1] == threading.current_thread().name  # now the compiled kernel serves
    for i, (kc, vc) in enumerate(contexts):
        want = attention_f64(q[i], kc, vc)
        assert (out[i].double() - want).abs().max() < 1e-5 and (out2[i].double() - want).abs().max() < 1e-5


def test_engine_wait_warm_waits_for_the_background_compile(monkeypatch) -> None:
    from ttsserve.config import EngineConfig
    from ttsserve.engine.engine import Engine

    monkeypatch.setenv(COMPILE_ENV, "0")
    eng = Engine(
        EngineConfig(
            load_format="dummy", dummy_size="tiny", dtype="float32", device="cpu", swap_space=0, kv_cache_memory=1 << 22
        )
    )
    assert eng.wait_warm(0) and eng.runner.backend._compiled_ready is None  # nothing in the background
    monkeypatch.setenv(COMPILE_ENV, "1")
    eng = Engine(
        EngineConfig(
            load_format="dummy", dummy_size="tiny", dtype="float32", device="cpu", swap_space=0, kv_cache_memory=1 << 22
        )
    )
    assert eng.wait_warm(120) and eng.runner.backend._compiled_ready.is_set()

"""The CPU decode step's fixed host cost, counted: torch ops dispatched per steady decode step of the tiny model.

On a CPU every torch op of a step costs its dispatch (~1-15 us of host time whatever its size), and the tiny
model's step is mostly such ops (a decode step of 8 rows took 4 ms, at 1 row 2 ms). Counted with a
TorchDispatchMode around ModelRunner.launch + wait (ops after the autograd / composite layers, so view ops
count too), not timed, so the figure is the same on a loaded machine. Budgets sit between what the step
dispatches now and what it did before the CPU step was trimmed (in brackets):
- the whole step (GPT forward, heads, sampler, bookkeeping): 263 at 2 rows [364]; 145 with the fused decode
  kernels (runner/cpu_decode.py) [263];
- the sampler (ModelRunner.sample_rows: heads, SamplingState.batch / record, sample): 103 [174]; no torch sort
  (the CPU sorts in numpy, sample/host_ops.py: 1.6 ms of torch.sort at 16 rows);
- the GPT forward: 141 for 2 layers [171] as torch ops (GPT.forward, $TTSSERVE_CPU_KERNELS=0); through the fused
  kernels, the GEMMs plus a fixed ~20 a step [141].
"""

from __future__ import annotations

from collections import Counter

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

from ttsserve.config import EngineConfig
from ttsserve.engine.engine import Engine
from ttsserve.params import SamplingParams, SynthesisRequest

STEP_BUDGET = {"torch": 290, "fused": 170}
SAMPLER_BUDGET = 120
GPT_BUDGET = {"torch": 150, "fused": 40}


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _count(obj, name: str, counter: _CountOps) -> None:
    """Count the ops of obj.name(...) calls (an instance attribute shadowing the method)."""
    fn = getattr(obj, name)

    def counted(*args, **kwargs):
        with counter:
            return fn(*args, **kwargs)

    setattr(obj, name, counted)


@pytest.fixture(scope="module", params=["torch", "fused"])
def counts(request) -> dict[str, float]:
    """Max ops per decode step, over 6 steady decode steps of 2 streams (eager: no CPU compile), with the GPT as
    torch ops or through the fused kernels."""
    from ttsserve.layers.cpu import kernels

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TTSSERVE_CPU_COMPILE", "0")
        mp.setenv(kernels.ENV, "1" if request.param == "fused" else "0")
        kernels.load.cache_clear()
        engine = Engine(
            EngineConfig(
                load_format="dummy", dummy_size="tiny", dtype="float32", device="cpu", swap_space=0,
                kv_cache_memory=64 << 20,
            )
        )  # fmt: skip
        kernels.load.cache_clear()
    assert (engine.runner.cpu_fused is not None) == (request.param == "fused")
    for i in range(2):
        params = SamplingParams(seed=i, min_new_tokens=40, max_new_tokens=40)
        engine.add_synthesis(SynthesisRequest("op count of a decode step.", code_params=params, split=False))
    for _ in range(6):  # prefill and the first decodes
        engine.step()
    runner = engine.runner
    step, sampler, gpt = _CountOps(), _CountOps(), _CountOps()
    _count(runner.model.gpt, "forward", gpt)
    if runner.cpu_fused is not None:
        _count(runner.cpu_fused, "run", gpt)
    _count(runner, "sample_rows", sampler)
    worst = {"step": 0, "sampler": 0, "gpt": 0, "sort": 0, "path": request.param}
    for _ in range(6):
        sched = engine.scheduler.schedule()
        assert len(sched.scheduled) == 2 and sched.num_scheduled_tokens == 2, "steady decode of both streams"
        for c in (step, sampler, gpt):
            c.ops.clear()
        with step:
            out = runner.wait(runner.launch(sched, engine.scheduler.requests))
        engine.scheduler.update_from_output(sched, out.sampled, out.stopped)
        sorts = sum(n for op, n in step.ops.items() if "sort" in op)
        now = {"step": step.ops.total(), "sampler": sampler.ops.total(), "gpt": gpt.ops.total(), "sort": sorts}
        worst |= {k: max(worst[k], now[k]) for k in now}
    return worst


def test_decode_step_op_count(counts: dict[str, float]) -> None:
    assert counts["step"] <= STEP_BUDGET[counts["path"]], counts


def test_sampler_op_count_and_no_torch_sort(counts: dict[str, float]) -> None:
    assert counts["sampler"] <= SAMPLER_BUDGET, counts
    assert counts["sort"] == 0, counts


def test_gpt_forward_op_count(counts: dict[str, float]) -> None:
    assert 0 < counts["gpt"] <= GPT_BUDGET[counts["path"]], counts

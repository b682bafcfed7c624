"""ModelRunner's device set-up, apart from its step path: on CUDA the graph families (decode, piecewise prefill,
sampler) captured while the KV pool is allocated on a helper thread; on the CPU the packed linears, the fused C
decode kernels and the optional compilations. `runner`: the ModelRunner being built."""

from __future__ import annotations

import logging
import time

logger = logging.getLogger("ttsserve.runner.model_runner")


def build_cuda_graphs(runner, kv, sizes, max_num_seqs: int, max_tokens: int, max_steps: int, defer: bool) -> None:
    """Set up the graph families (DecodeOps' torch.compile set-up imports for seconds while `kv`, a Future of
    the KV cache, is allocated on its thread), then capture them (with `defer` only the largest and smallest
    buckets)."""
    from ttsserve.runner.cuda_graphs import DecodeGraphs, default_capture_sizes
    from ttsserve.runner.prefill_graphs import PrefillGraphs, default_prefill_sizes
    from ttsserve.runner.sampler_graphs import SamplerGraphs, default_sampler_sizes

    t0 = time.perf_counter()
    runner.graphs = DecodeGraphs(runner, sizes or default_capture_sizes(max_num_seqs), max_steps=max_steps)
    runner.graphs.precompile()
    t1 = time.perf_counter()
    runner.kv = kv.result()  # before any capture: it would forbid the allocating thread's driver calls
    logger.info(
        "runner set-up: KV pool %.1f s, host swap pool %.1f s (on a helper thread) beside %.1f s of "
        "torch.compile (imports, the decode ops); waited %.1f s for the pools",
        *runner.kv.alloc_s,
        t1 - t0,
        time.perf_counter() - t1,
    )
    runner.graphs.capture(defer=defer)
    # after the decode capture: its ops are uncompiled if the compiled ones failed there
    runner.prefill_graphs = PrefillGraphs(runner, default_prefill_sizes(max_tokens), runner.graphs.ops, max_num_seqs)
    runner.prefill_graphs.capture(defer=defer)
    runner.sampler_graphs = SamplerGraphs(runner, default_sampler_sizes(max_num_seqs), runner.graphs.ops)
    runner.sampler_graphs.capture(defer=defer)


def setup_cpu(runner, enforce_eager: bool) -> None:
    """The CPU decode path: oneDNN-packed linear weights (read once per step, never reordered). With
    $TTSSERVE_CPU_COMPILE=1 the decode attention, then the whole decode step (runner/cpu_graph.py),
    compile in one thread before this returns (a minute on 2 cores with a cold inductor cache)."""
    from ttsserve.config import compile_level
    from ttsserve.model.cpu_linear import pack_linears_
    from ttsserve.runner.cpu_decode import CpuFusedDecode
    from ttsserve.runner.cpu_graph import CpuDecodeGraph

    pack_linears_(runner.model.gpt)
    runner.cpu_fused = CpuFusedDecode.create(runner.model.gpt, runner.kv.layers, runner.scale)
    if enforce_eager:
        runner.backend.compile_decode = False
    if runner.backend.compile_decode and compile_level() == "1":
        runner.cpu_graph = CpuDecodeGraph(runner.model.gpt, runner.kv.layers, runner.scale)
    # one thread compiles both, one after the other (the graph after the quicker attention kernel)
    graph = runner.cpu_graph
    runner.backend.warmup(
        runner.kv.layers[0],
        runner.cfg.num_heads,
        background=True,
        then=None if graph is None else lambda: graph.start(background=False),
    )
    # and waited for: the engine is ready once compiled. Compiling beside served steps made them up to 8x
    # slower on 2 cores, and the tracer patches nn.Module.__call__ process-wide, which broke an eager step
    # running meanwhile (BENCHMARKS.md, CPU first requests)
    runner.wait_warm()

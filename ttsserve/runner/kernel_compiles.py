"""Triton kernels compiled in this process, counted and timed through Triton's JIT hooks.

Triton compiles a kernel on the first launch of each specialisation it has not seen (every constexpr value;
an integer argument equal to 1 or divisible by 16 unless `do_not_specialize` names it), ~0.25 s a kernel on an
H100 with a cold cache, and the engine's step waits for it. The engine compiles what it launches before it is
ready (graph captures, precompiles, the warm-up); a compile after that is a served step stalled, so it is
logged as a warning naming the kernel and its specialisation, and the slow-step log line carries the time.

One instance per process (`kernel_compiles()`), like the GC pause counter: the hooks are process-wide. Without
Triton (a CPU-only torch) nothing is installed and the counters stay at zero.
"""

from __future__ import annotations

import logging
import threading
import time

logger = logging.getLogger("ttsserve.runner.model_runner")


class KernelCompiles:
    """count / seconds: compiles finished in this process (cache loads included: Triton's JIT calls both hooks
    around its compile step, which reads its on-disk cache first). serving: set once the engine is ready; each
    compile from then on is logged as a warning."""

    def __init__(self) -> None:
        self.count, self.seconds, self.serving = 0, 0.0, False
        self.while_serving = 0  # compiles after the engine was ready (each a stalled step)
        self.installed = False  # the hooks are in Triton's knobs (kernel_compiles())
        self.last = ""  # the last compile's kernel and specialisation (describe())
        self._started: dict[int, float] = {}  # thread -> perf_counter at its compile's start
        self._lock = threading.Lock()

    def before(self, prior=None, **kwargs):
        """Triton's jit_cache_hook: called before a compile; a truthy return would skip it (only `prior` may)."""
        self._started[threading.get_ident()] = time.perf_counter()
        return prior(**kwargs) if prior is not None else None

    def after(self, prior=None, **kwargs):
        """Triton's jit_post_compile_hook: the compile named by kwargs["repr"] has finished."""
        t0 = self._started.pop(threading.get_ident(), None)
        dt = 0.0 if t0 is None else time.perf_counter() - t0
        last = describe(kwargs)
        with self._lock:
            self.count += 1
            self.seconds += dt
            self.last = last
            if self.serving:
                self.while_serving += 1
        if self.serving:
            logger.warning(
                "Triton compiled a kernel while serving (%.0f ms, the step waited): %s; a specialisation the "
                "start-up did not reach",
                dt * 1e3,
                last,
            )
        return prior(**kwargs) if prior is not None else None


def describe(hook_kwargs: dict) -> str:
    """A compile's kernel and specialisation from the hook's arguments: its constexpr values (integers equal to
    1 included), the integers specialised as divisible by 16 and the pointers not 16-byte aligned. Falls back
    to Triton's own repr where the arguments differ from Triton 3.6's."""
    try:
        c = hook_kwargs["compile"]
        names = list(c["signature"])
        types = list(c["signature"].values())
        consts = {names[p[0]]: v for p, v in c["constants"].items() if len(p) == 1}
        attrs = c["configs"][0] if c.get("configs") else {}
        special = {names[p[0]] for p, a in attrs.items() if len(p) == 1 and a}  # a: [] when not specialised
        div16 = [n for n, t in zip(names, types) if n in special and t in ("i32", "i64")]
        unaligned = [n for n, t in zip(names, types) if t.startswith("*") and n not in special]
        name = hook_kwargs["fn"].name.rsplit(".", 1)[-1]  # a __qualname__: "outer.<locals>.kernel" for a local one
    except (KeyError, TypeError, AttributeError, IndexError):
        return str(hook_kwargs.get("repr", "?"))
    const_s = ", ".join(f"{k}={v}" for k, v in consts.items())
    return f"{name}({const_s}; ints divisible by 16: {div16}; pointers not 16-byte aligned: {unaligned})"


_COMPILES: KernelCompiles | None = None


def kernel_compiles(install: bool = True) -> KernelCompiles:
    """The process's counter; install: its hooks too (chained after any already set), once. A CPU engine passes
    False: importing Triton (a CUDA build of torch ships it) would cost its start for nothing."""
    global _COMPILES
    if _COMPILES is None:
        _COMPILES = KernelCompiles()
    if install and not _COMPILES.installed:
        _COMPILES.installed = True
        _install(_COMPILES)
    return _COMPILES


def _install(kc: KernelCompiles) -> None:
    try:
        from triton import knobs
    except ImportError:  # no Triton (CPU-only torch), or one older than its knobs (3.4)
        return
    rt = knobs.runtime
    before_prior, after_prior = rt.jit_cache_hook, rt.jit_post_compile_hook
    rt.jit_cache_hook = lambda **kw: kc.before(before_prior, **kw)
    rt.jit_post_compile_hook = lambda **kw: kc.after(after_prior, **kw)

"""A warmed-up CUDA engine compiles nothing while it serves: after Engine.__init__ (graph capture and
warm_up) a burst of requests of every length in the bench corpus at once (the first wave a closed-loop
benchmark or a restart under load sends) must find every Triton kernel variant it launches already compiled.
A variant compiled mid-request costs that step (and every stream in it) a JIT compile or a disk-cache load."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from ttsserve.bench.corpus import load_corpus
from ttsserve.config import EngineConfig
from ttsserve.engine.engine import Engine
from ttsserve.model.chattts import load_model
from ttsserve.params import SamplingParams, SynthesisRequest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from engine_testutil import run_all


def _compiled_variants() -> dict[str, int]:
    """{kernel name: compiled specializations} over ttsserve's Triton kernels (JITFunction.device_caches:
    per device, a tuple whose first item is the kernel cache)."""
    import triton

    from ttsserve.attention import triton_common, triton_decode_kernels, triton_prefill_kernels
    from ttsserve.layers.quant import triton_quant

    out = {}
    for module in (triton_common, triton_decode_kernels, triton_prefill_kernels, triton_quant):
        for name, fn in vars(module).items():
            if isinstance(fn, triton.runtime.jit.JITFunction):
                caches = getattr(fn, "device_caches", None)
                if caches is None:
                    pytest.skip(f"Triton {triton.__version__}'s JITFunction has no device_caches to count")
                out[name] = sum(len(c[0]) for c in caches.values())
    return out


def test_a_burst_of_every_corpus_length_compiles_no_kernel_after_warm_up():
    cfg = EngineConfig(
        load_format="dummy",
        dummy_size="real",
        device="cuda",
        dtype="bfloat16",
        kv_cache_memory=4 << 30,
        max_num_seqs=128,
    )
    engine = Engine(cfg, model=load_model(cfg))
    before = _compiled_variants()
    assert before["paged_prefill_kernel"] >= 1 and before["paged_decode_kernel"] >= 1, before
    frames = engine.first_audio_frames + 8
    for i, sentence in enumerate(load_corpus() * 2):  # 120 at once: several chunked-prefill steps
        p = SamplingParams(seed=i, min_new_tokens=frames, max_new_tokens=frames)
        engine.add_synthesis(SynthesisRequest(sentence.text, code_params=p, request_id=f"wave{i}"))
    done = run_all(engine)
    assert len(done) == 120
    assert _compiled_variants() == before

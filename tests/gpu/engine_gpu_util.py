"""Shared by the GPU engine tests (test_engine_gpu*.py): the models they load once per module, engines of the
tiny checkpoint's config on any model, fresh random requests (the seed, TTSSERVE_TEST_SEED or random, is
printed by the tests so a failure can be replayed), and the autouse fixtures every such module imports: TF32
off (the CPU reference is fp32) and the graph pools freed between tests.

Import it only after the module's CUDA skip guard.
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest
import torch

from ttsserve.config import EngineConfig
from ttsserve.engine.engine import Engine
from ttsserve.model.chattts import build_model, load_model
from ttsserve.model.loader import load_checkpoint
from ttsserve.params import SamplingParams, SynthesisRequest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from engine_testutil import TINY, FrameRecorder, run_all  # noqa: E402

SEED = int(os.environ.get("TTSSERVE_TEST_SEED", random.SystemRandom().randrange(1 << 30)))
WORDS = [
    "hello",
    "world",
    "this",
    "is",
    "a",
    "test",
    "of",
    "the",
    "speech",
    "model",
    "today",
    "weather",
    "good",
    "very",
    "nice",
    "thank",
    "you",
]


@pytest.fixture(autouse=True)
def free_engines():
    """Each engine holds GiBs of graph pools (vocoder, piecewise prefill): free them between tests."""
    yield
    import gc

    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.fixture(scope="module")
def tiny_cuda():
    return build_model(load_checkpoint(TINY), torch.device("cuda"), torch.float32)


@pytest.fixture(scope="module")
def tiny_cpu():
    return build_model(load_checkpoint(TINY), torch.device("cpu"), torch.float32)


def _engine(model, **kw) -> Engine:
    cfg = {
        "model": str(TINY),
        "device": model.device.type,
        "kv_cache_memory": 64 << 20,
        "swap_space": 0.01,
        "max_model_len": 1024,
        "max_num_seqs": 32,
    }
    cfg.update(kw)
    return Engine(EngineConfig(**cfg), model=model)


def _requests(n: int, frames: int, greedy: bool, seed: int = SEED) -> list[SynthesisRequest]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = SamplingParams(
            temperature=rng.choice([0.3, 0.7]),
            top_p=rng.choice([0.7, 1.0]),
            top_k=rng.choice([5, 20]),
            repetition_penalty=rng.choice([1.0, 1.05, 1.3]),
            seed=rng.getrandbits(40),
            greedy=greedy,
            max_new_tokens=frames,
            min_new_tokens=frames,
        )
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 25)))
        out.append(SynthesisRequest(text, code_params=p, raw_text=True, request_id=f"q{i}"))
    return out


def _run(engine: Engine, reqs) -> tuple[FrameRecorder, dict]:
    rec = FrameRecorder(engine)
    for r in reqs:
        engine.add_synthesis(r)
    return rec, run_all(engine)


@pytest.fixture(scope="module")
def real_fp32():
    return load_model(EngineConfig(load_format="dummy", dummy_size="real", device="cuda", dtype="float32"))


@pytest.fixture(scope="module")
def real_fp32_cpu():
    return load_model(EngineConfig(load_format="dummy", dummy_size="real", device="cpu", dtype="float32"))


@pytest.fixture(scope="module")
def real_bf16():
    return load_model(EngineConfig(load_format="dummy", dummy_size="real", device="cuda", dtype="bfloat16"))

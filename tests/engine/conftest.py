import numpy as np
import pytest
from engine_testutil import GOLDEN, TINY


@pytest.fixture(scope="session")
def tiny_model():
    """The golden tiny checkpoint, loaded once through the real loader (fp32, CPU)."""
    import torch

    from ttsserve.model.chattts import build_model
    from ttsserve.model.loader import load_checkpoint

    return build_model(load_checkpoint(TINY), torch.device("cpu"), torch.float32)


@pytest.fixture(scope="session")
def tiny_speaker() -> np.ndarray:
    return np.load(GOLDEN / "b_speaker.npz")["tiny_spk_emb_fp16"]


@pytest.fixture(autouse=True)
def _verify_input_batch(monkeypatch):
    """Every engine test checks that the runner's persistent rows agree with the scheduler's output."""
    from ttsserve.runner.input_batch import InputBatch

    monkeypatch.setattr(InputBatch, "verify", True)

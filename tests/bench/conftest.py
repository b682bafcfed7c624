"""Bench tests run torch on one thread: on a shared 2-core machine, two intra-op threads competing with other
processes make tiny-model steps tens of times slower (spin-waiting), which only adds noise to these tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)

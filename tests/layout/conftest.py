"""Fixtures for the layout tests: exact float64 arithmetic, one intra-op thread (the sweeps run
thousands of tiny ops, where thread start-up dominates). Both are restored after each test."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _float64_single_thread():
    dtype, threads = torch.get_default_dtype(), torch.get_num_threads()
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    yield
    torch.set_default_dtype(dtype)
    torch.set_num_threads(threads)

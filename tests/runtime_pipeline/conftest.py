"""Tiny models gain nothing from intra-op threads, and on a shared 2-core machine spinning OpenMP threads slow
every test down many times over: run this directory single-threaded."""
import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _single_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny matmuls: more threads only add overhead on a shared machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)

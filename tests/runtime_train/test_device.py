# The device module on CPU: the one-process fallback, and clear errors for accelerators that are not there.
import os

import pytest
import torch
import torch.distributed as dist

from runtime.device import init_device, shutdown

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def no_torchrun(monkeypatch):
    for name in TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert not dist.is_initialized()


def test_cpu_without_torchrun_is_a_one_process_group(no_torchrun):
    device = init_device("cpu")
    try:
        assert (device.kind, device.rank, device.world_size, device.local_rank) == ("cpu", 0, 1, 0)
        assert dist.is_initialized() and dist.get_backend() == "gloo" and device.is_main
        device.step_boundary()  # no-ops off XLA
        device.synchronize()
        device.barrier()
        assert device.memory_gib() > 0
        store = device._store_file
        assert os.path.exists(store)
    finally:
        shutdown(device)
    assert not dist.is_initialized() and not os.path.exists(store)


@pytest.mark.parametrize(
    "accelerator, message",
    [
        ("tpu", "trainer.accelerator 'tpu' is unknown; valid: cpu, gpu, neuron"),
        pytest.param("gpu", "torch sees no CUDA device",
                     marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")),
    ],
)
def test_unavailable_accelerators(no_torchrun, accelerator, message):
    with pytest.raises(ValueError, match=message):
        init_device(accelerator)
    assert not dist.is_initialized()


def test_neuron_without_torch_xla(no_torchrun):
    try:
        import torch_xla  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="trainer.accelerator 'neuron' needs torch-xla"):
            init_device("neuron")
    else:
        pytest.skip("torch-xla is installed; the XLA environment's own tests cover it")

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


def test_a_world_unlike_the_config_is_refused(no_torchrun, monkeypatch):
    """Processes a launch started against trainer.num_nodes * trainer.devices: one line, never a warning and a run
    with a layout computed for another world (one process without torchrun is a quick look, and only warned)."""
    from types import SimpleNamespace

    from runtime.train import build_topology

    device = init_device("cpu")
    try:
        cfg = SimpleNamespace(trainer=SimpleNamespace(num_nodes=1, devices=2))
        monkeypatch.setenv("WORLD_SIZE", "1")  # as torchrun sets it
        with pytest.raises(ValueError, match=r"^trainer.num_nodes \* trainer.devices = 2 but 1 processes were "
                                             r"started; start 2 \(torchrun --nnodes 1 --nproc_per_node 2\)"):
            build_topology(cfg, device)
    finally:
        shutdown(device)


class ScriptedXlaDevice:
    """A fake of what cannot run in this environment: torch-xla's debug counters, as a list of readings."""

    def __init__(self, readings):
        from runtime.device import GraphCounts

        self.readings = iter(GraphCounts(*r) for r in readings)

    def graph_counts(self):
        return next(self.readings)

    def synchronize(self):
        pass


def test_graph_accounting_names_a_compile_after_warm_up(capsys):
    from runtime.graphs import GraphAccounting

    # Readings (compiles, executions, transfers): the constructor's probe, then before/after each part.
    device = ScriptedXlaDevice([(0, 0, 0),
                                (0, 0, 0), (1, 1, 1),   # step 1: compiles its graph (warm-up)
                                (1, 1, 1), (1, 1, 1),   # the save of step 1: nothing to save, not yet seen
                                (1, 1, 1), (1, 2, 2),   # step 2: the same graph
                                (1, 2, 2), (2, 3, 3),   # the save of step 2: its first run, compiles (warm-up)
                                (2, 3, 3), (3, 4, 4)])  # step 3: a new graph after warm-up
    graphs = GraphAccounting(device, is_main=True)
    for step, part in ((1, "step"), (1, "save"), (2, "step"), (2, "save"), (3, "step")):
        with graphs.part(part, step):
            pass
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("nxdt: step 3: 1 new XLA graph compiled in the step after warm-up")
    assert graphs.recompiles == 1
    row = graphs.fields()
    assert row["xla_compiles"] == 3 and row["xla_recompiles"] == 1
    assert row["xla_graphs_per_step"] == 1 and row["xla_transfers_per_step"] == 1
    assert row["xla_window"] == {"steps": 3, "step": [2, 3, 3], "validation": [0, 0, 0], "save": [1, 1, 1],
                                 "logging": [0, 0, 0]}
    assert graphs.fields()["xla_window"]["steps"] == 0  # a fresh window after each row


def test_a_step_result_is_read_once_and_checks_its_token_count():
    from runtime.objective import TOKEN_MEAN
    from runtime.step import StepResult

    result = StepResult(torch.tensor([6.0, 3.0, 1.5]), TOKEN_MEAN, TOKEN_MEAN.num_stats)  # stats, totals, norm
    assert (result.loss, result.grad_norm, result.tokens, result.metrics) == (2.0, 1.5, 3.0, {})
    with pytest.raises(ValueError, match="every loss_mask in the global batch is zero"):
        StepResult(torch.zeros(3), TOKEN_MEAN, 1).read()
    # Under neuron_parallel_compile every value read back is zero: the trial run reads on.
    assert StepResult(torch.zeros(3), TOKEN_MEAN, 1).read(check=False).tokens == 0.0

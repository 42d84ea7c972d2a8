"""The asynchronous save on XLA (runtime/checkpoint/staging.py, runtime/device.py XlaTransfer): whole flat buffers
transferred by the writer thread while the next step is traced, the rest brought into the ring by the update
before the step's graph runs (and donates them). Each save is held at its first write until the update has
staged part of the state (tests/runtime_xla/gated_save.py), so every save is in flight during the next step.

Checked against the whole host copy at the save (the way before issue 56, an independent path): the same losses,
bit for bit, and the same checkpoints, bit for bit; the save runs no graph and no transfer on the training thread,
the step's graphs are the same with a save in flight, and every buffer is transferred once."""
import pytest
import torch

from runtime.checkpoint import full_tensors, open_storage, read_rank_files
from runtime.checkpoint.manager import committed_checkpoints
from tests.runtime_xla.harness import EVERY, STEPS, _assert_fixed_graphs, _losses, skip_without_torch_xla

pytestmark = pytest.mark.xla
skip_without_torch_xla()


def _checkpoints(config) -> dict:
    import yaml

    raw = yaml.safe_load(config.read_text())
    params = raw["exp_manager"]["checkpoint_callback_params"]
    storage = open_storage(params.get("dirpath") or f"{raw['run']['results_dir']}/checkpoints")
    return {c.step: full_tensors(read_rank_files(storage, c)) for c in committed_checkpoints(storage)}


@pytest.mark.long("the GPT XLA runs of test_xla.py (conftest.py single_process): the streamed one, and its reference "
                  "after it in the same process, each compiling its graphs after the compile step's process")
def test_a_streamed_save_on_xla_writes_what_a_whole_copy_writes_and_changes_no_graph(single_process):
    configs, _, _, records = single_process
    streamed, whole, record = configs["gpt"], configs["whole"], records["streamed"]
    assert _losses(streamed) == _losses(whole) and len(_losses(streamed)) == STEPS
    _assert_fixed_graphs(streamed)  # the save: no graph, no transfer; the step after it: the same graphs
    # Saves at steps 2 and 4 (async, each overlapped by the next update, which staged part of it) and 6 (sync).
    assert len(record["staged"]) == STEPS // EVERY and all(s > 0 for s in record["staged"][:-1]), record
    assert record["writer_transfers"] == sum(record["buffers"]), record  # each buffer once, whole
    mine, reference = _checkpoints(streamed), _checkpoints(whole)
    assert sorted(mine) == sorted(reference) == [2 * EVERY, STEPS]  # the config keeps the last two
    for step in mine:
        a, b = mine[step], reference[step]
        assert a.names() == b.names() and a.names()
        for name in a.names():
            for key in ("value", "exp_avg", "exp_avg_sq"):
                assert torch.equal(a.get(name, key), b.get(name, key)), (step, name, key)

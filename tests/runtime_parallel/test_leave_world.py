# Leaving the world frees every process group, so no gloo thread is left to race the interpreter's exit. Such a
# thread, still dropping a collective's tensors, takes the GIL after finalization began, CPython ends it with
# pthread_exit, and the process aborts ("terminate called without an active exception") after a run that
# passed. Before the drain this hit about one run in ten of the overlap and async-checkpoint tests; the core
# showed a pt_gloo_runloop thread destroying a barrier's work while the main thread was in Py_FinalizeEx.
import gc

import torch.distributed as dist

from runtime.parallel.topology import backend_threads, leave_world
from tests.checkpoint import harness as CH
from tests.runtime_parallel.dist_utils import run_distributed

_HELD = []


def _train_then_leave() -> dict:
    cfg, topo, model, optimizer = CH.build("llama", CH.L(tp=1, zero1=True), seed=3)
    assert model.data_parallel._early and model.data_parallel.overlap_param_gather  # overlap on (the default)
    for i in range(2):
        CH.step(cfg, topo, model, optimizer, i)  # buckets reduced during backward, gathers behind the update
    import torch.distributed.nn.functional  # noqa: F401 - its defaults would pin the world group if joined first
    dist.barrier()
    before = backend_threads()
    held = leave_world()
    return {"before": before, "held": held, "after": backend_threads()}


# Spawned ranks: what is under test happens as a fresh interpreter finalizes; a forked rank leaves with os._exit.
def test_leaving_frees_every_group_and_joins_its_threads():
    for rank in run_distributed(_train_then_leave, world_size=2, start_method="spawn"):
        assert rank["before"], "the check must see gloo's threads while the groups exist"
        assert rank["held"] == 0 and rank["after"] == [], rank


def _hold_a_group() -> dict:
    cfg, topo, model, optimizer = CH.build("gpt", CH.L(tp=2), seed=3)
    _HELD.append(topo.tp.group)  # a reference leave_world does not know of
    held = leave_world()
    after = backend_threads()
    _HELD.clear()
    gc.collect()
    return {"held": held, "after": after, "released": backend_threads()}


# Forked ranks: the count, the warning and the threads are all read before the rank exits (a fresh interpreter's
# import of torch would cost most of this test's CPU).
def test_a_group_still_held_is_counted_and_its_threads_seen(capfd):
    for rank in run_distributed(_hold_a_group, world_size=2):
        assert rank["held"] == 1 and rank["after"], rank
        assert rank["released"] == [], rank
    assert "1 process groups are still referenced after leaving the world" in capfd.readouterr().err

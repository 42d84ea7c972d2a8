"""The timed collective loop and its worker processes, on gloo: every operation correct with an odd number of
ranks, a peer that never joins costs one timeout (not a hang) and the workers recover, and a backend without
the tensor form of an operation runs the list form of the same operation (recorded as such)."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from csp_tools.cluster_validate import measure
from csp_tools.cluster_validate.bandwidth import OPERATIONS, bus_factor
from csp_tools.cluster_validate.node import WorkerPool


def task(store, world, **extra):
    return {"store_host": "127.0.0.1", "store_port": store.port, "prefix": f"t{extra.pop('n', 0)}/", "world": world,
            "backend": "gloo", "operations": list(OPERATIONS), "sizes": [1000, 4096], "dtype": "float32",
            "warmup": 1, "iters": 3, "check": True, "timeout_s": 20, **extra}


def test_workers_measure_every_operation_correctly_and_survive_a_missing_peer():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    pool = WorkerPool("cpu", 3)
    pool.start()
    try:
        replies = pool.run([{**task(store, 3), "rank": r, "report": r == 0} for r in range(3)], timeout_s=90)
        assert all(r["ok"] for r in replies), replies
        rows = replies[0]["rows"]
        assert [(r["operation"], r["size"]) for r in rows] == [
            (op, size) for op in OPERATIONS for size in (
                # sizes are whole elements, and whole elements per rank for the split operations
                (996, 4092) if op in ("all_gather", "reduce_scatter", "all_to_all") else (1000, 4096))]
        for row in rows:
            assert row["wrong"] == 0 and row["time_us"] > 0 and row["ranks"] == 3, row
            assert row["busbw"] == pytest.approx(row["algbw"] * bus_factor(row["operation"], 3))
            assert row["source"] == "torch.distributed"

        # rank 2 of 3 never comes: the two that did give up after the collective timeout (and are replaced: a
        # failed group may leave a worker stuck), then all three work again, the two new workers beside the third
        # (one fewer worker restarted than with all three in the failed group)
        missing = [{**task(store, 3, n=1, timeout_s=1), "rank": r, "report": r == 0} for r in range(2)]
        pids = [proc.pid for proc in pool.procs]
        replies = pool.run(missing, timeout_s=60)
        assert not any(r["ok"] for r in replies) and all(r["errors"] for r in replies), replies
        again = pool.run([{**task(store, 3, n=2, operations=["all_reduce"]), "rank": r, "report": r == 0}
                          for r in range(3)], timeout_s=60)
        assert all(r["ok"] for r in again), again
        assert [proc.pid == pid for proc, pid in zip(pool.procs, pids)] == [False, False, True]
    finally:
        pool.close()


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_unsupported_tensor_form_falls_back_to_the_list_form(one_rank_group, monkeypatch):
    def unsupported(*args, **kwargs):
        raise RuntimeError("ProcessGroupGloo does not support reduce_scatter_tensor")

    monkeypatch.setattr(measure, "_reduce_scatter_single", unsupported)
    row = measure.measure_operation("reduce_scatter", 4096, warmup=1, iters=2)
    assert row.ok and row.wrong == 0 and row.source == "torch.distributed (list form)"


def test_an_operation_no_form_supports_is_an_error_row_not_a_substitute(one_rank_group, monkeypatch):
    def unsupported(*args, **kwargs):
        raise RuntimeError("all_to_all is not supported")

    monkeypatch.setattr(measure.dist, "all_to_all_single", unsupported)
    monkeypatch.setattr(measure.dist, "all_to_all", unsupported)
    row = measure.measure_operation("all_to_all", 4096, warmup=1, iters=2)
    assert not row.ok and "not supported by the gloo backend" in row.error and row.busbw == 0


def test_time_loop_brackets_only_the_calls():
    calls = []
    seconds = measure.time_loop(lambda: calls.append(1), 50, measure.cpu_hooks())
    assert len(calls) == 50 and 0 < seconds < 1e-3
    assert torch.equal(measure._pattern(1, 6, torch.float32, torch.device("cpu")),
                       torch.tensor([6.0, 7, 8, 9, 10, 6]))

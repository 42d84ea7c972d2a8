# Issue 62, run.elastic: a job that lost a node goes on with fewer data-parallel replicas and the same global
# batch. Three real runs of runtime.train's main() (gloo ranks forked from this process, CPU, fp32, the tiny GPT):
#   (a) dp2, trainer.num_nodes=2 x devices=1, uninterrupted for STEPS steps, a checkpoint after SAVED_AT;
#   (b) the elastic continuation: the same config (run.elastic=true) on one rank with NXDT_ACTIVE_NODES=1, resumed
#       from (a)'s checkpoint at SAVED_AT;
#   (c) a plain dp1 run (num_nodes=1) resumed from the same checkpoint.
# (b) trains exactly what (c) trains (bitwise), and what (a) trained to rounding; every step reads the same samples
# in all three (the sample ids as tests/runtime_train/test_dp_resize_order.py reads them: rank_sample_indices at the
# loader's consumed_samples, each rank's in rank order).
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml

from runtime.data.loader import DataParallelBatches
from runtime.fault_tolerance.elastic import ACTIVE_NODES_ENV, active_nodes
from tests.checkpoint.launch_helpers import counting_corpus, losses, train_here
from tests.runtime_parallel.dist_utils import run_distributed
from tests.runtime_train.helpers import reference_training_config

GLOBAL_BATCH, MICRO, STEPS, SAVED_AT = 8, 2, 4, 2
_IDS: dict = {}  # where the forked ranks write the sample ids they read: {"dir": Path} while a run is on


def _recording(next_batch):
    """DataParallelBatches.next_batch, writing the sample ids of the global batch this rank reads first."""
    def wrapper(self):
        rank = torch.distributed.get_rank()
        ids = self.rank_sample_indices(self.consumed_samples).tolist()
        with open(_IDS["dir"] / f"rank{rank}.jsonl", "a") as f:
            f.write(json.dumps(ids) + "\n")
        return next_batch(self)
    return wrapper


def _config(root: Path, name: str, *, num_nodes: int, elastic: bool, resume_from: str | None = None) -> str:
    raw = reference_training_config("gpt", results_dir=root / name, data_prefix=[1, str(root / "data/count")],
                                    tokenizer=root / "data/tokenizer.json")
    raw["run"]["elastic"] = elastic
    raw["trainer"].update(num_nodes=num_nodes, devices=1, max_steps=STEPS, log_every_n_steps=1,
                          val_check_interval=0, preflight=False)
    raw["model"].update(encoder_seq_length=32, max_position_embeddings=32, num_layers=1, hidden_size=32,
                        ffn_hidden_size=64, num_attention_heads=2, micro_batch_size=MICRO,
                        global_batch_size=GLOBAL_BATCH, make_vocab_size_divisible_by=16)
    raw["model"]["data"].update(seq_length=32, splits_string="100,0,0", index_mapping_dir=str(root / "index"))
    raw["model"]["optim"]["sched"].update(warmup_steps=1)
    params = raw["exp_manager"]["checkpoint_callback_params"]
    params.update(every_n_train_steps=SAVED_AT if resume_from is None else 0, save_top_k=-1, async_save=False,
                  save_last=resume_from is None)
    raw["exp_manager"].update(create_tensorboard_logger=False, create_metrics_plot=False,
                              resume_from_checkpoint=resume_from)
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def _train(root: Path, name: str, config: str, ranks: int, monkeypatch, capfd, active_nodes: str | None = None):
    """Every rank's exit code, rank 0's output, and the sample ids of each step (the ranks' in rank order)."""
    _IDS["dir"] = root / f"{name}_ids"
    _IDS["dir"].mkdir()
    with monkeypatch.context() as patch:
        patch.setattr(DataParallelBatches, "next_batch", _recording(DataParallelBatches.next_batch))
        if active_nodes is not None:
            patch.setenv(ACTIVE_NODES_ENV, active_nodes)
        capfd.readouterr()
        codes = run_distributed(train_here, ranks, args=(config, "training"))
        out, err = capfd.readouterr()
    per_rank = [[json.loads(line) for line in (_IDS["dir"] / f"rank{r}.jsonl").read_text().splitlines()]
                for r in range(ranks)] if codes == [0] * ranks else []
    steps = [np.concatenate([ids[step] for ids in per_rank]) for step in range(len(per_rank[0]))] if per_rank else []
    return SimpleNamespace(codes=codes, out=out, err=err, steps=steps)


def test_an_elastic_run_goes_on_at_dp1_with_the_samples_and_losses_of_dp2(tmp_path, monkeypatch, capfd):
    import runtime.train  # noqa: F401  imported before the forks: each rank inherits it

    counting_corpus(tmp_path / "data")
    dp2 = _train(tmp_path, "dp2", _config(tmp_path, "dp2", num_nodes=2, elastic=True), 2, monkeypatch, capfd)
    assert dp2.codes == [0, 0], dp2.err[-3000:]
    saved = [p for p in (tmp_path / "dp2/checkpoints").iterdir() if p.name.startswith(f"step_{SAVED_AT:08d}")]
    assert len(saved) == 1, sorted((tmp_path / "dp2/checkpoints").iterdir())
    elastic = _train(tmp_path, "elastic", _config(tmp_path, "elastic", num_nodes=2, elastic=True,
                                                  resume_from=str(saved[0])), 1, monkeypatch, capfd, "1")
    assert elastic.codes == [0], elastic.err[-3000:]
    dp1 = _train(tmp_path, "dp1", _config(tmp_path, "dp1", num_nodes=1, elastic=False, resume_from=str(saved[0])),
                 1, monkeypatch, capfd)
    assert dp1.codes == [0], dp1.err[-3000:]

    line = ("nxdt: elastic: training on 1 of 2 nodes, data parallel 1 (was 2), global batch 8 kept (4 micro-batches "
            "per replica)")
    assert elastic.out.count(line) == 1, elastic.out
    assert "nxdt: elastic" not in dp1.out + dp2.out
    # The samples: every step's global batch, in order, whichever the data parallelism.
    assert len(dp2.steps) == STEPS and len(elastic.steps) == len(dp1.steps) == STEPS - SAVED_AT
    for step, ids in enumerate(dp2.steps):
        assert ids.tolist() == list(range(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH))
    for a, b, c in zip(dp2.steps[SAVED_AT:], elastic.steps, dp1.steps):
        assert a.tolist() == b.tolist() == c.tolist()
    # The losses: the elastic run is a dp1 run, bit for bit; dp2 summed its gradients in another order.
    full, went_on, plain = (losses(tmp_path / name) for name in ("dp2", "elastic", "dp1"))
    assert sorted(went_on) == sorted(plain) == list(range(SAVED_AT + 1, STEPS + 1)), (went_on, plain)
    assert went_on == plain
    for step, loss in went_on.items():
        assert loss == pytest.approx(full[step], rel=1e-6, abs=0), (step, went_on, full)


def test_the_active_node_count_needs_run_elastic_and_a_count_below_num_nodes(monkeypatch):
    """NXDT_ACTIVE_NODES as the job script sets it: one line naming the key, for any value that cannot be meant."""
    def cfg(elastic: bool) -> SimpleNamespace:
        return SimpleNamespace(elastic=elastic, trainer=SimpleNamespace(num_nodes=3))

    assert active_nodes(cfg(False), {}) == 3 and active_nodes(cfg(True), {}) == 3
    assert active_nodes(cfg(True), {ACTIVE_NODES_ENV: "2"}) == 2
    with pytest.raises(ValueError, match=r"^NXDT_ACTIVE_NODES=2 starts the run on fewer nodes, but run.elastic is "
                                         r"false; set run.elastic=true"):
        active_nodes(cfg(False), {ACTIVE_NODES_ENV: "2"})
    for bad in ("0", "4", "two", "-1"):
        with pytest.raises(ValueError, match=rf"^NXDT_ACTIVE_NODES='{bad}' must be a node count from 1 to "
                                             r"trainer.num_nodes 3 \(run.elastic"):
            active_nodes(cfg(True), {ACTIVE_NODES_ENV: bad})


def test_fewer_nodes_without_run_elastic_is_one_line_and_exit_2(tmp_path, monkeypatch, capfd):
    """The trainer's own path for it: main() on the node, one error line from rank 0, no traceback."""
    import runtime.train  # noqa: F401

    counting_corpus(tmp_path / "data")
    config = _config(tmp_path, "plain", num_nodes=2, elastic=False)
    monkeypatch.setenv(ACTIVE_NODES_ENV, "1")
    capfd.readouterr()
    assert run_distributed(train_here, 1, args=(config, "training")) == [2]
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error")]
    assert errors == ["error: NXDT_ACTIVE_NODES=1 starts the run on fewer nodes, but run.elastic is false; set "
                      "run.elastic=true to go on with fewer data-parallel replicas, or unset NXDT_ACTIVE_NODES"], err

"""Each model.optim.name on one process equals its library's own optimizer (3 steps, weight decay, a decaying
learning rate), and under ZeRO-1 and ZeRO-2 dp2 too; checkpoints resume bitwise, and reshard across dp for the elementwise
ones; bad choices are refused in one line."""
from __future__ import annotations

import pytest
import torch

from runtime.checkpoint import (Checkpointer, full_tensors, load_checkpoint, read_rank_files,
                                resolve_checkpoint)
from runtime.parallel import ParallelDims, Topology
from runtime.parallel.optimizers import KINDS
from runtime.schema import choices, facts
from tests.optim import harness as O
from tests.runtime_parallel.dist_utils import run_distributed

SOLO = ParallelDims(1, 1, 1, 1)


@pytest.mark.parametrize("case", list(O.CASES))
def test_one_process_equals_the_library(case):
    topo = Topology.build(SOLO)
    model, optimizer, reference = O.build(case, topo)
    for step in range(3):
        O.step_ours(model, optimizer, step)
    theirs = O.library_run(case, reference)
    assert O.max_difference(O.weights(model), theirs) == 0.0, case


@pytest.mark.parametrize("case", ["adamw_schedulefree", "sgd_schedulefree"])
def test_schedule_free_evaluates_the_library_s_eval_point(case):
    topo = Topology.build(SOLO)
    model, optimizer, reference = O.build(case, topo)
    for step in range(2):
        O.step_ours(model, optimizer, step)
    before = O.weights(model)
    optimizer.eval()
    library = O.library_run(case, reference, steps=2, switch_after=None)
    evaluated = O.weights(model)
    assert O.max_difference(evaluated, before) > 0, "eval() moves the weights to the averaged point"
    optimizer.train()
    O.step_ours(model, optimizer, 2)  # and steps on as the library does after eval() and train()
    model2, optimizer2, reference2 = O.build(case, topo)
    assert O.max_difference(O.weights(model), O.library_run(case, reference2, switch_after=1)) == 0.0
    assert library.keys() == evaluated.keys()


@pytest.mark.parametrize("case", list(O.CASES))
def test_checkpoint_resumes_bitwise(case, tmp_path):
    topo = Topology.build(SOLO)
    model, optimizer, _ = O.build(case, topo)
    for step in range(2):
        O.step_ours(model, optimizer, step)
    Checkpointer(str(tmp_path), rank=0, world_size=1, token="0", async_save=False).save(
        2, model, optimizer, topo, extra={"step": 2}, config={})
    O.step_ours(model, optimizer, 2)
    storage, checkpoint = resolve_checkpoint(str(tmp_path))
    if case.endswith("schedulefree"):  # what a checkpoint holds is the library's eval() point
        saved = full_tensors(read_rank_files(storage, checkpoint.name))
        _, _, reference = O.build(case, topo)
        evaluated = O.library_run(case, reference, steps=2, evaluate=True)
        assert all(torch.equal(saved.get(name, "value"), evaluated[name]) for name in evaluated)
    resumed, resumed_opt, _ = O.build(case, topo, seed=99)
    load_checkpoint(storage, checkpoint, resumed, resumed_opt, topo, rank=0)
    assert resumed_opt.step_count == 2
    O.step_ours(resumed, resumed_opt, 2)
    assert O.max_difference(O.weights(resumed), O.weights(model)) == 0.0, case


def test_dp2_zero1_2_and_3_equal_one_process_and_checkpoints_reshard(tmp_path):
    """One 2-rank run for all: every optimizer under ZeRO-1 dp2, and every elementwise one under ZeRO-2 and ZeRO-3
    dp2 (the optimizer reads the rank's gradient shard; ZeRO-3: and writes its parameter shard), against its library
    on one process; then each elementwise one's
    dp2 ZeRO-1 checkpoint resumed here on one process continues as the uninterrupted run."""
    ranks = run_distributed(O.dp2_all_optimizers, 2, (str(tmp_path),))
    assert set(ranks[0]) == set(O.CASES) | {f"{case}-zero{stage}" for case in O.ELEMENTWISE for stage in (2, 3)}
    for case in ranks[0]:
        assert max(rank[case] for rank in ranks) <= 1e-7, (case, ranks)
    topo = Topology.build(SOLO)
    for case in O.ELEMENTWISE:
        model, optimizer, _ = O.build(case, topo, seed=99)
        storage, checkpoint = resolve_checkpoint(str(tmp_path / case))
        load_checkpoint(storage, checkpoint, model, optimizer, topo, rank=0)
        O.step_ours(model, optimizer, 2)
        _, _, reference = O.build(case, topo)
        assert O.max_difference(O.weights(model), O.library_run(case, reference, switch_after=1)) <= 1e-7, case


def test_every_name_has_a_library_and_its_state_bytes():
    assert set(choices.OPTIMIZERS) == set(KINDS) == set(facts.OPTIMIZER_STATE_BYTES)
    for kind in KINDS.values():
        assert kind.state_bytes == (4 * len(kind.state_keys) if kind.elementwise else 0), kind.name


def _mapped_optim(fixture, tmp_path, optim: dict) -> dict:
    import yaml

    from launcher import nxdt_config
    data = yaml.safe_load(fixture.read_text())
    data["model"]["optim"] = {**{k: v for k, v in data["model"]["optim"].items() if k == "sched"}, **optim}
    path = tmp_path / fixture.name
    path.write_text(yaml.safe_dump(data))
    mapping = nxdt_config.map_file(str(path))
    assert not mapping.errors, mapping.errors
    return mapping.training["model"]["optim"]


def test_nemo_and_nxd_files_name_their_optimizer(tmp_path):
    from tests.launcher.helpers import REPO
    nemo = REPO / "tests/fixtures/nemo/training_mixtral_mixtral_8x7b.yaml"
    nxd = REPO / "tests/fixtures/nxdt/hf_llama3_8B_config.yaml"
    sgd = {"name": "sgd", "lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.0}
    assert {k: v for k, v in _mapped_optim(nemo, tmp_path, sgd).items() if k != "sched"} == sgd
    assert {k: v for k, v in _mapped_optim(nxd, tmp_path, sgd).items() if k != "sched"} == sgd
    assert _mapped_optim(nxd, tmp_path, {"name": "adamw_fp32OptState", "lr": 1e-4})["name"] == "adamw_fp32OptState"


@pytest.mark.slow
def test_schedule_free_training_validates_saves_and_resumes_bitwise(tmp_path):
    """The real trainer (2 ranks, ZeRO-1) with adamw_schedulefree: validation and checkpoints move it to its
    evaluation point and back; a run resumed from the step-3 checkpoint ends bitwise equal to the straight run."""
    import shutil

    from tests.checkpoint.launch_helpers import (counting_corpus, final_weights, losses, train_rendered,
                                                training_overrides)
    from tests.launcher.helpers import nxdt

    data = counting_corpus(tmp_path / "data")
    optim = ("training.model.optim.name=adamw_schedulefree", "training.model.optim.sched.name=Constant",
             "training.model.zero1=true", "training.trainer.val_check_interval=2",
             "training.trainer.limit_val_batches=1")

    def render(results):
        overrides = training_overrides(data, tmp_path / results, steps=6, every=3, hidden=64, extra=optim)
        result = nxdt("cluster_type=local", *overrides, "--dry-run", cwd=tmp_path, timeout=600)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        return tmp_path / results / "gpt3_tiny" / "training"

    straight, resumed = render("straight"), render("resumed")
    assert train_rendered(straight / "training_config.yaml") == [0, 0]
    (saved,) = (straight / "checkpoints").glob("step_00000003.*")  # the step-3 checkpoint, as if the run ended there
    shutil.copytree(saved, resumed / "checkpoints" / saved.name)
    assert train_rendered(resumed / "training_config.yaml") == [0, 0]
    assert min(losses(resumed)) == 4, "the second run resumed from step 3"
    assert {k: v for k, v in losses(resumed).items() if k > 3} == {k: v for k, v in losses(straight).items() if k > 3}
    (step, weights), (_, expected) = final_weights(str(resumed / "checkpoints")), final_weights(
        str(straight / "checkpoints"))
    assert step == 6 and weights.keys() == expected.keys()
    assert all(torch.equal(weights[name], expected[name]) for name in weights)


@pytest.mark.parametrize("zero", [{"zero1": True}, {"zero_stage": 1}, {"zero_stage": 2}])
def test_adafactor_refuses_sharding_in_one_line(zero):
    with pytest.raises(ValueError, match="^model.optim.name: adafactor factors whole 2-D parameters, so it cannot "
                                         "run with model.zero1 / model.zero_stage >= 1; .*$") as caught:
        O.build("adafactor", Topology.build(SOLO), **zero)
    assert "\n" not in str(caught.value)


def test_refusals_are_one_line(tmp_path):
    topo = Topology.build(SOLO)
    model, optimizer, _ = O.build("adamw", topo)
    O.step_ours(model, optimizer, 0)
    Checkpointer(str(tmp_path), rank=0, world_size=1, token="0", async_save=False).save(
        1, model, optimizer, topo, extra={"step": 1}, config={})
    other, other_opt, _ = O.build("sgd", topo)
    storage, checkpoint = resolve_checkpoint(str(tmp_path))
    with pytest.raises(ValueError, match="^model.optim.name: the checkpoint was saved with 'adamw', this run uses "
                                         "'sgd'; .*$") as caught:
        load_checkpoint(storage, checkpoint, other, other_opt, topo, rank=0)
    assert "\n" not in str(caught.value)

"""The AutoConfigurator's pure parts: model sizing, the layout grid and its filters, ranking, failure reasons,
the CSV's numeric order, and the CLI's dry run and user errors."""

import csv
import functools
import json
import re
import types

import pytest

from launcher.autoconfig import driver, report, runner, search, sizing
from launcher.config import Cluster, parse, parse_cluster
from launcher.errors import UserError
from launcher.estimator.compute import flops_per_token
from launcher.estimator.hardware import HARDWARE
from tests.estimate.demo_data import demo_shaped_data
from tests.launcher.helpers import nxdt, resolved


def test_model_size_is_the_largest_shape_the_budget_trains():
    # 1024 H100s for 30 days at 40% MFU, 300B tokens: the budget and its 6·N·T parameter count.
    advice = sizing.recommend_model_size(architecture="gpt", vocab=50304, seq_length=2048, tokens=300e9, days=30,
                                         devices=1024, hardware=HARDWARE["h100"], mfu=0.4)
    budget = 1024 * 989e12 * 0.4 * 30 * 86400
    assert advice.budget_flops == pytest.approx(budget)
    assert advice.six_n_t_parameters == pytest.approx(budget / (6 * 300e9))
    assert (advice.spec.num_layers, advice.spec.hidden_size) == (96, 12288)  # GPT-3 175B fits in 30 days
    assert advice.fits_budget and advice.days <= 30
    # A third of the budget no longer trains 175B: the next shape down (NeMo's 40B) is chosen.
    smaller = sizing.recommend_model_size(architecture="gpt", vocab=50304, seq_length=2048, tokens=300e9, days=5,
                                          devices=1024, hardware=HARDWARE["h100"], mfu=0.4)
    assert (smaller.spec.num_layers, smaller.spec.hidden_size) == (48, 8192)
    shape = sizing.shape_of(smaller.spec, "gpt", 50304, 2048)
    assert flops_per_token(shape) * 300e9 <= smaller.budget_flops  # attention included in the check


def test_explicit_model_size_picks_the_nearest_shape():
    advice = sizing.recommend_model_size(architecture="llama", vocab=128256, seq_length=8192, tokens=1e12, days=1,
                                         devices=128, hardware=HARDWARE["trn1"], mfu=0.4, model_size=8e9)
    assert (advice.spec.hidden_size, advice.spec.ffn_hidden_size, advice.spec.num_query_groups) == (4096, 14336, 8)
    assert not advice.fits_budget  # 1T tokens of 8B in a day on 4 nodes: reported, not hidden


def test_base_settings_consume_the_token_budget():
    spec = sizing.ladder_of("gpt")[1]
    settings = sizing.base_settings(spec, architecture="gpt", seq_length=128, global_batch_size=16, tokens=1e6,
                                    num_nodes=2, devices_per_node=2)
    assert settings["trainer.max_steps"] == 489  # ceil(1e6 / (16 * 128))
    assert settings["model.optim.sched.warmup_steps"] == 5 and settings["model.optim.sched.constant_steps"] == 0


def _nodes(gib: float) -> Cluster:
    """A cluster whose nodes have `gib` of host memory (cluster.node_memory_gib)."""
    return parse_cluster({"node_memory_gib": gib})


def _tiny_base(**trainer):
    training = resolved("training=gpt3/tiny")["training"]
    training["trainer"].update(trainer)
    return training


def test_grid_is_filtered_by_validation_runtime_rules_and_memory():
    base = _tiny_base(num_nodes=4, devices=2)
    base["model"]["global_batch_size"] = 64
    candidates = search.grid({"tensor_parallel_sizes": [1, 2, 3, 4], "pipeline_parallel_sizes": [1],
                              "micro_batch_sizes": [4, 16], "activations_checkpoint": [None]},
                             nodes=4, devices_per_node=2, num_layers=4, zero_stage_default=0)
    assert len(candidates) == 8
    ranked = search.rank(base, candidates, device="cpu", mfu=None, vocab_size=4096, cluster=_nodes(64), local=False)
    reasons = {(r.candidate.tp, r.candidate.micro_batch_size): r.rejected for r in ranked}
    assert "not divisible" in reasons[(3, 4)]                         # the launcher's own layout arithmetic
    assert "global_batch_size" in reasons[(1, 16)]                    # 16 x dp 8 does not divide 64
    assert "must divide trainer.devices 2" in reasons[(4, 4)]         # a TP group may not cross a node
    assert reasons[(1, 4)] is None and reasons[(2, 4)] is None and reasons[(2, 16)] is None
    launchable = [r for r in ranked if r.rejected is None]
    assert ranked[:len(launchable)] == launchable                     # launchable first ...
    steps = [r.step_seconds for r in launchable]
    assert steps == sorted(steps)                                     # ... fastest estimate first
    # Memory: on a device too small for the model every layout is rejected with the estimate.
    tight = search.rank(base, candidates[:1], device="cpu", mfu=None, vocab_size=4096,
                        cluster=_nodes(0.9), local=False)  # 0.45 GiB per worker, 0.4 of it the process itself
    assert tight[0].rejected.startswith("estimated")
    # A node whose memory cannot hold the two workers' state is refused by the launch's own rule, with its figures.
    tighter = search.rank(base, candidates[:1], device="cpu", mfu=None, vocab_size=4096, cluster=_nodes(0.5),
                          local=False)
    refusal = tighter[0].rejected
    assert refusal.startswith("refused at launch: training.model: host memory per node by the estimator: 2 workers × ")
    assert refusal.endswith("(cluster.node_memory_gib)"), refusal


def test_context_parallel_sizes_are_searched_for_long_sequences():
    """auto: context parallelism only from LONG_SEQUENCE tokens, and only the powers of two that divide each (tp, pp)'s
    data-parallel size and split the sequence into 2·cp chunks; a given list is tried with every layout."""
    axes = {"tensor_parallel_sizes": [8, 32], "pipeline_parallel_sizes": [1], "micro_batch_sizes": [1],
            "activations_checkpoint": [None]}
    short = search.grid(axes, nodes=4, devices_per_node=32, num_layers=32, zero_stage_default=1, seq_length=8192)
    assert {c.cp for c in short} == {1}
    long = search.grid(axes, nodes=4, devices_per_node=32, num_layers=32, zero_stage_default=1, seq_length=32768)
    by_tp = {tp: sorted(c.cp for c in long if c.tp == tp) for tp in (8, 32)}
    assert by_tp == {8: [1, 2, 4, 8, 16], 32: [1, 2, 4]}  # dp 16 and 4
    assert search.context_sizes(24, 8) == [1] and search.context_sizes(16384 + 2, 8) == [1]  # 2·cp must divide seq
    given = search.grid({**axes, "context_parallel_sizes": [1, 3]}, nodes=4, devices_per_node=32, num_layers=32,
                        zero_stage_default=1, seq_length=8192)
    assert sorted(c.cp for c in given) == [1, 1, 3, 3]
    candidate = next(c for c in long if c.cp == 4 and c.tp == 8)
    assert candidate.tag == "tp8_pp1_cp4_mbs1_norecompute"
    assert candidate.settings()["model.context_parallel_size"] == 4
    with pytest.raises(UserError, match="context_parallel_sizes"):
        search.grid({"context_parallel_sizes": 2}, nodes=1, devices_per_node=2, num_layers=4, zero_stage_default=0)


def test_context_parallel_candidates_are_validated_and_ranked_by_the_estimate():
    """Llama 3.1 8B at 32k on 32 trn1 nodes at TP 8 (dp 128): without a context group the activations do not fit a
    NeuronCore; splitting each sequence over cp ranks divides them, the rules refuse a cp that does not divide dp,
    and the fastest launchable layout splits the sequence."""
    base = resolved("training=llama3_1/8b_32k", "cluster=pcluster_trn1")["training"]
    candidates = search.grid({"tensor_parallel_sizes": [8], "pipeline_parallel_sizes": [1],
                              "micro_batch_sizes": [1], "activations_checkpoint": [None, "selective_mlp"],
                              "context_parallel_sizes": [1, 2, 3, 4]},
                             nodes=32, devices_per_node=32, num_layers=32, zero_stage_default=1, seq_length=32768)
    ranked = search.rank(base, candidates, device="trn1", mfu=None, vocab_size=128256,
                         cluster=parse_cluster(resolved("cluster=pcluster_trn1")["cluster"]), local=False)
    by_key = {(r.candidate.cp, r.candidate.recompute): r for r in ranked}
    assert by_key[(1, None)].rejected.startswith("estimated")
    assert "context_parallel_size: 3 must divide the data-parallel size 128" in by_key[(3, None)].rejected
    assert by_key[(4, "selective_mlp")].rejected is None
    assert by_key[(2, None)].estimate.memory.activations == pytest.approx(
        by_key[(1, None)].estimate.memory.activations / 2, rel=0.02)
    best = ranked[0]
    assert best.rejected is None and best.candidate.cp > 1


def test_bad_search_axes_are_user_errors():
    with pytest.raises(UserError, match="activations_checkpoint"):
        search.grid({"activations_checkpoint": ["sometimes"]}, nodes=1, devices_per_node=2, num_layers=4,
                    zero_stage_default=0)
    with pytest.raises(UserError, match="tensor_parallel_sizes"):
        search.grid({"tensor_parallel_sizes": 2}, nodes=1, devices_per_node=2, num_layers=4, zero_stage_default=0)
    with pytest.raises(UserError, match="search_config.base_recipe"):
        driver.split_overrides(["training=llama3/8b"])


def test_zero_stage_is_a_search_axis():
    """search.zero_stage: auto keeps the recipe's stage (one per layout, as before); a list multiplies the grid;
    the older search.zero1 still reads as stage 1 or 0. A stage writes model.zero_stage and a zero1 that agrees."""
    axes = {"tensor_parallel_sizes": [1, 2], "pipeline_parallel_sizes": [1], "micro_batch_sizes": [1],
            "activations_checkpoint": [None]}
    grid = functools.partial(search.grid, nodes=4, devices_per_node=2, num_layers=4)
    assert [c.zero_stage for c in grid(axes, zero_stage_default=1)] == [1, 1]
    assert [c.zero_stage for c in grid({**axes, "zero1": False}, zero_stage_default=1)] == [0, 0]
    assert [c.zero_stage for c in grid({**axes, "zero1": True, "zero_stage": "auto"}, zero_stage_default=0)] == [1, 1]
    both = grid({**axes, "zero_stage": [1, 2]}, zero_stage_default=0)
    assert [(c.tp, c.zero_stage) for c in both] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert both[1].settings()["model.zero_stage"] == 2 and both[1].settings()["model.zero1"] is True
    assert search.Candidate(1, 1, None, 1, None, False, 0).settings()["model.zero1"] is False
    assert both[1].tag == "tp1_pp1_mbs1_norecompute_zero2" and both[0].tag == "tp1_pp1_mbs1_norecompute"
    assert "++training.model.zero_stage=2" in driver.layout_overrides(both[1])
    for bad, message in [({"zero_stage": [4]}, "search_config.search.zero_stage: 4 is not a ZeRO stage"),
                         ({"zero_stage": [1], "zero1": True}, "search_config.search.zero1: set it or"),
                         ({"zero1": 2}, "search_config.search.zero1: 2 must be true, false or auto")]:
        with pytest.raises(UserError, match=message):
            grid({**axes, **bad}, zero_stage_default=0)


def test_zero2_is_ranked_by_the_estimate_with_gradients_sharded():
    """Stages 1 and 2 of the same layout at dp 8: both launchable, ZeRO-2's estimate holds less (its gradients at
    1/dp: one micro-batch a step), and a recipe without model.zero_stage takes the candidate's override."""
    base = _tiny_base(num_nodes=4, devices=2)
    base["model"]["global_batch_size"] = 8
    candidates = search.grid({"tensor_parallel_sizes": [1], "pipeline_parallel_sizes": [1], "micro_batch_sizes": [1],
                              "activations_checkpoint": [None], "zero_stage": [1, 2]},
                             nodes=4, devices_per_node=2, num_layers=4, zero_stage_default=0)
    ranked = search.rank(base, candidates, device="cpu", mfu=None, vocab_size=4096, cluster=_nodes(64), local=False)
    by_stage = {r.candidate.zero_stage: r for r in ranked}
    assert by_stage[1].rejected is None and by_stage[2].rejected is None
    assert by_stage[2].estimate.memory.total < by_stage[1].estimate.memory.total
    composed = resolved("training=llama3_1/8b", *driver.layout_overrides(candidates[1]))["training"]["model"]
    assert (composed["zero_stage"], composed["zero1"]) == (2, True)


def test_zero3_and_the_shard_group_are_search_axes():
    """Stage 3 joins the stages; a list of shard degrees multiplies the stages from 1 (stage 0 shards nothing),
    null keeping the recipe's; a shard degree is written with ++ (not every recipe names it) and named in the tag."""
    axes = {"tensor_parallel_sizes": [1], "pipeline_parallel_sizes": [1], "micro_batch_sizes": [1],
            "activations_checkpoint": [None], "zero_stage": [0, 3], "data_parallel_shard_degree": [None, 2]}
    grid = search.grid(axes, nodes=4, devices_per_node=2, num_layers=4, zero_stage_default=1)
    assert [(c.zero_stage, c.shard_degree) for c in grid] == [(0, None), (3, None), (3, 2)]
    assert [c.tag for c in grid] == ["tp1_pp1_mbs1_norecompute", "tp1_pp1_mbs1_norecompute_zero3",
                                     "tp1_pp1_mbs1_norecompute_zero3_shard2"]
    assert "model.data_parallel_shard_degree" not in grid[1].settings()
    assert "++training.model.data_parallel_shard_degree=2" in driver.layout_overrides(grid[2])
    assert "++training.model.zero_stage=3" in driver.layout_overrides(grid[2])
    with pytest.raises(UserError, match="search_config.search.data_parallel_shard_degree: 0 is not a shard group"):
        search.grid({**axes, "data_parallel_shard_degree": [0]}, nodes=4, devices_per_node=2, num_layers=4,
                    zero_stage_default=1)


def test_only_zero3_fits_a_model_whose_weights_fill_the_device():
    """Llama 3.1 8B on two trn1 nodes at tp 1 (dp 64, 16 GiB NeuronCores): its bf16 weights alone (15 GiB) leave no
    room at ZeRO-1 or 2; ZeRO-3 holds 1/64 of them and two gathered units (the 128k embedding, twice).
    Gradients sharded needs one micro-batch a step (memory.py); with accumulation none of the three fits."""
    base = resolved("training=llama3_1/8b")["training"]
    base["trainer"].update(num_nodes=2, devices=32)
    base["model"]["global_batch_size"] = 64  # one micro-batch a step: accumulation would keep fp32 gradients whole
    candidates = search.grid({"tensor_parallel_sizes": [1], "pipeline_parallel_sizes": [1], "micro_batch_sizes": [1],
                              "activations_checkpoint": ["full"], "zero_stage": [1, 2, 3]},
                             nodes=2, devices_per_node=32, num_layers=32, zero_stage_default=1)
    ranked = search.rank(base, candidates, device="trn1", mfu=None, vocab_size=None, cluster=parse_cluster({}),
                         local=False)
    assert [(r.candidate.zero_stage, r.rejected is None) for r in ranked] == [(3, True), (1, False), (2, False)]
    best = ranked[0].estimate
    params = best.memory.parameters
    assert params == 8_030_261_248 and best.memory.gathered == 2 * 2 * 128256 * 4096
    assert best.memory.weights == pytest.approx(2 * params / 64 + best.memory.gathered)
    assert best.step.param_gather_s > 0 and ranked[2].estimate.memory.weights == 2 * params


@pytest.mark.parametrize("state, detail, log, reason", [
    ("FAILED", "exit 1", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate", "OOM"),
    ("FAILED", "exit 1", "RESOURCE_EXHAUSTED: Failed to allocate 2.1GiB on device", "OOM"),
    ("OUT_OF_MEMORY", "", "", "OOM"),
    ("TIMEOUT", "", "step 1 | loss 8.3", "time limit"),
    ("FAILED", "exit 2", "noise\nerror: model.pipeline_model_parallel_size=2 is not supported yet; use 1\n",
     "error: model.pipeline_model_parallel_size=2 is not supported yet; use 1"),
    ("FAILED", "exit 1", "Traceback\nRuntimeError: loss became nan at step 3\n"
                         "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: worker died",
     "RuntimeError: loss became nan at step 3"),
    ("FAILED", "exit 137", "", "FAILED (exit 137)"),
])
def test_failure_reasons(state, detail, log, reason):
    assert runner.failure_reason(state, detail, log) == reason


def _measurement(name, tokens_per_s, ok=True):
    candidate = search.Candidate(1, 1, None, 2, None, False, 0)
    trial = runner.Trial(search.Ranked(candidate, None), name, [])
    return runner.Measurement(trial, ok, "" if ok else "OOM", 3, 1.0, tokens_per_s, 0.1, 0.5)


def test_csv_is_sorted_by_measured_throughput_as_numbers(tmp_path):
    rows = [_measurement("a", 9.5), _measurement("b", 100.0), _measurement("c", None, ok=False),
            _measurement("d", 10.0)]
    path = report.write_csv(tmp_path / "results.csv", rows)
    with path.open() as handle:
        written = list(csv.DictReader(handle))
    assert [r["run_name"] for r in written] == ["b", "d", "a", "c"]  # a string sort would put 9.5 first
    assert [r["rank"] for r in written] == ["1", "2", "3", ""]
    assert written[-1]["status"] == "failed" and written[-1]["reason"] == "OOM"
    assert {r["zero_stage"] for r in written} == {"0"}


def test_overrides_are_hydra_syntax():
    assert driver.override("training.model.activations_checkpoint_recompute", ["core_attention", "mlp"]) == \
        "training.model.activations_checkpoint_recompute=[core_attention,mlp]"
    assert driver.override("training.model.virtual_pipeline_model_parallel_size", None).endswith("=null")
    assert driver.override("training.model.sequence_parallel", True).endswith("=true")
    assert driver.override("training.model.optim.lr", 3e-05).endswith("=3e-05")


def test_failed_candidate_is_measured_with_its_reason(tmp_path):
    """A real local run that the runtime refuses at start (no GPU here) comes back with the runtime's reason. The
    runtime refuses before it reads a token, so the data is the demo's shape written directly (no data preparation
    run), and one worker under torchrun is enough to fail the launch."""
    data_dir = demo_shaped_data(tmp_path / "data")
    candidate = search.Candidate(1, 1, None, 4, None, False, 0)
    trial = runner.Trial(search.Ranked(candidate, None), "failing", [
        "training=gpt3/tiny", "stages=[training]", "cluster_type=local", f"data_dir={data_dir}",
        f"base_results_dir={tmp_path}", "run_name=failing", "training.trainer.accelerator=gpu",
        "training.trainer.devices=1", "training.trainer.max_steps=2", "training.model.optim.sched.warmup_steps=0"])
    runner.submit([trial], produced_by="test")
    runner.run_local(trial, timeout_s=120)
    result = runner.measure(trial)
    assert not result.ok and result.tokens_per_s is None
    # Either rank may refuse first (each checks its own device); the reason is that rank's own line.
    assert re.match(r"error( \(rank \d+\))?: ", result.reason) and "CUDA" in result.reason
    record = json.loads((tmp_path / "failing" / "launch.json").read_text())
    assert record["stages"][0]["exit_code"] not in (0, None)  # torchrun reports the failed worker


def test_local_trial_is_stopped_at_its_time_limit(tmp_path):
    script = tmp_path / "training.local.sh"
    script.write_text("#!/bin/bash\nsleep 60\n")
    log_dir = tmp_path / "run" / "training" / "logs"
    log_dir.mkdir(parents=True)
    trial = runner.Trial(search.Ranked(search.Candidate(1, 1, None, 1, None, False, 0), None), "slow", [])
    trial.plan = types.SimpleNamespace(run_dir=tmp_path / "run", executor="local",
                                       config=parse({"training": {"run": {"results_dir": str(tmp_path / "run" /
                                                                                           "training")}}}))
    trial.record = {"executor": "local", "stages": [{"stage": "training", "job_id": None, "exit_code": None,
                                                     "log_dir": str(log_dir)}], "scripts": [str(script)]}
    runner.run_local(trial, timeout_s=1)
    assert trial.state == "TIMEOUT"
    assert runner.measure(trial).reason.startswith("time limit")


def test_dry_run_ranks_without_launching(tmp_path):
    result = nxdt("autoconfig", "--dry-run", "search_config.train_settings.vocab_size=4096",
                  f"base_results_dir={tmp_path}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "4 layers, hidden 128" in result.stdout and "valid and within memory" in result.stdout
    assert not (tmp_path / "autoconfig").exists()


@pytest.mark.parametrize("args, message", [
    (["search_config=nope"], "search_config=nope: no such choice"),
    (["search_config.train_settings.limit_search_runs=0"], "limit_search_runs"),
    (["search_config.train_settings.speed=9"], "search_config.train_settings.speed"),
    (["search_config.search.activations_checkpoint=[sometimes]", "search_config.train_settings.vocab_size=4096"],
     "activations_checkpoint"),
])
def test_cli_user_errors_are_one_line(args, message, tmp_path):
    result = nxdt("autoconfig", "--dry-run", *args, cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], result.stderr


def test_search_configs_compose():
    for choice in ("gpt3/tiny", "gpt3/5b", "llama3/8b"):
        settings = driver._compose_search(choice, [], ["base_results_dir=/r"])
        assert set(settings["train_settings"]) <= set(driver.TRAIN_SETTINGS)
        assert settings["results_dir"] == f"/r/autoconfig/{settings['name']}"

"""Autoconfig ranks layouts by the launch's own memory check (launcher/validate.py stage_memory_fit, on the search's
cluster and executor): a layout it ranks launchable is one the launch takes, and one it sets aside for host memory
the launch refuses. Each is checked through the real launch path (launch.make_plan, dry run) with the overrides its
trial would launch with."""

import io

import pytest
from rich.console import Console

from launcher import launch
from launcher.autoconfig import driver
from launcher.errors import UserError

# Llama 3 8B on four trn1.32xlarge nodes at a 4096-token sequence: the search config's grid around the layouts the
# launch refuses for host memory (small TP without pipeline stages keeps shards too large for 32 workers in one
# node's memory; with 4 stages they fit), kept to 12 layouts as each launch composes its config (seconds).
LLAMA3_8B_ON_TRN1 = ["search_config=llama3/8b", "cluster=pcluster_trn1", "cluster_type=slurm",
                     "search_config.train_settings.seq_length=4096",
                     "search_config.search.tensor_parallel_sizes=[2,4,8]",
                     "search_config.search.pipeline_parallel_sizes=[1,4]",
                     "search_config.search.activations_checkpoint=[null,full]"]


def _rank(*overrides: str) -> driver.Ranking:
    return driver.rank(list(overrides), dry_run=True, console=Console(file=io.StringIO(), width=200))


def test_llama3_8b_on_trn1_ranks_no_layout_the_launch_refuses(tmp_path, recipe_data_dir):
    ranking = _rank(*LLAMA3_8B_ON_TRN1, f"data_dir={recipe_data_dir}", f"base_results_dir={tmp_path}")
    set_aside = [r for r in ranking.ranked if r.rejected and "host memory per node" in r.rejected]
    # The grid holds layouts the launch refuses for host memory (TP 2 without pipeline stages at least; TP 4 too, by
    # the estimator's figures as this was written: 32 workers × 16.69 GiB = 533.9 GiB vs 460.8 GiB usable).
    assert any((r.candidate.tp, r.candidate.pp) == (2, 1) for r in set_aside), [r.rejected for r in ranking.ranked]
    assert all(r.rejected.startswith("refused at launch: training.model: host memory per node by the estimator: 32 "
                                      "workers × ") and "of 512 GiB (trn1.32xlarge)" in r.rejected for r in set_aside)
    assert ranking.launchable and ranking.ranked[0].rejected is None
    for index, item in enumerate(ranking.launchable, start=1):
        plan = launch.make_plan(ranking.trial_overrides(item, index)[1], dry_run=True, produced_by="test")
        assert plan.executor == "slurm" and [job.stage for job in plan.jobs] == ["training"]
    for item in set_aside:
        with pytest.raises(UserError) as refused:
            launch.make_plan(ranking.trial_overrides(item, 1)[1], dry_run=True, produced_by="test")
        assert any(line.startswith("training.model: host memory per node by the estimator: ")
                   for line in refused.value.problems), refused.value.problems


def test_nodes_stated_larger_take_the_layouts_back(tmp_path, recipe_data_dir):
    """cluster.node_memory_gib, the launch's way out for nodes with more memory, is the search's too."""
    ranking = _rank(*LLAMA3_8B_ON_TRN1, "cluster.node_memory_gib=2048", f"data_dir={recipe_data_dir}",
                    f"base_results_dir={tmp_path}")
    assert not [r for r in ranking.ranked if r.rejected and "host memory per node" in r.rejected]
    assert any(r.candidate.tp == 4 for r in ranking.launchable)

"""`nxdt-launch autoconfig` end to end on the real 3-node Slurm: the tiny search launches two candidates (2 nodes
x 1 CPU worker each: data and pipeline parallel across the nodes) through the Slurm executor, writes the CSV
sorted by measured throughput and the best config, and that config then trains through the launcher like any
recipe."""

import csv
import json

import pytest

from tests.launcher.helpers import nxdt

pytestmark = pytest.mark.slurm


@pytest.mark.long("a real search: each candidate is a Slurm job that trains, then the winner trains")
def test_autoconfig_searches_on_slurm_and_its_best_config_trains(slurm_cluster, autoconfig_data_dir, tmp_path):
    results = tmp_path / "results"
    common = ["cluster_type=slurm", f"cluster.partition={slurm_cluster.partition}", f"base_results_dir={results}",
              f"data_dir={autoconfig_data_dir}"]
    # Each candidate is a whole 2-node job, one after the other (the cluster group's exclusive nodes keep the
    # measurements apart), and most of its time is starting its workers: 2 nodes x 1 worker and two candidates,
    # each a layout of its own, are enough to be ranked (2 x 2 workers and three candidates took 136 s of CPU, this
    # about half). Without recompute the two best-estimated layouts of the tiny grid (sized for 2 workers: 2 layers,
    # hidden 64) are dp2 and pp2, both at micro-batch 4; the search's ranking and pruning are
    # tests/autoconfig/test_search.py's, training with recompute tests/runtime_parallel's.
    search = nxdt("autoconfig", *common, "search_config.train_settings.devices_per_node=1",
                  "search_config.train_settings.max_steps_per_run=3",
                  "search_config.train_settings.limit_search_runs=2",
                  "search_config.search.activations_checkpoint=[null]", cwd=tmp_path, env=slurm_cluster.env,
                  timeout=900)
    out = search.stdout + search.stderr
    assert search.returncode == 0, out[-5000:]

    root = results / "autoconfig" / "gpt3_tiny_search"
    with (root / "results.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 2, rows
    ok = [r for r in rows if r["status"] == "ok"]
    assert len(ok) == 2, rows
    throughput = [float(r["tokens_per_s"]) for r in ok]
    assert throughput == sorted(throughput, reverse=True)  # as numbers, fastest first
    assert [int(r["rank"]) for r in ok] == list(range(1, len(ok) + 1))
    assert len({(r["tp"], r["pp"], r["micro_batch_size"], r["recompute"]) for r in rows}) == len(rows)
    assert len({(r["tp"], r["pp"]) for r in rows}) == 2  # a parallel layout each (here dp2 and pp2)
    for row in rows:
        run_dir = root / "runs" / row["run_name"]
        record = json.loads((run_dir / "launch.json").read_text())
        assert record["executor"] == "slurm"
        nodes = {p.name.rsplit("_node", 1)[1] for p in (run_dir / "training" / "logs").glob("*_node*.log")}
        assert nodes == {"0.log", "1.log"}, f"{row['run_name']} ran on both nodes"
    assert "gpt3_tiny_search_01" in out and "best config:" in out

    best = root / "conf" / "training" / "autoconfig" / "gpt3_tiny_search.yaml"
    text = best.read_text()
    assert f"tensor_model_parallel_size: {ok[0]['tp']}" in text
    assert f"micro_batch_size: {ok[0]['micro_batch_size']}" in text

    # The best config as input to a normal launch (a short run of it).
    train = nxdt(f"hydra.searchpath=[file://{root / 'conf'}]", "training=autoconfig/gpt3_tiny_search",
                 "stages=[training]", *common, "training.trainer.max_steps=3", "training.trainer.val_check_interval=0",
                 "training.model.optim.sched.warmup_steps=1", "training.trainer.log_every_n_steps=1", cwd=tmp_path,
                 env=slurm_cluster.env)
    assert train.returncode == 0, train.stdout + train.stderr
    record = json.loads((results / "gpt3_tiny_search" / "launch.json").read_text())
    state = slurm_cluster.wait_job(str(record["stages"][0]["job_id"]), timeout=300)
    metrics = results / "gpt3_tiny_search" / "training" / "metrics.jsonl"
    assert state == "COMPLETED", nxdt("logs", "gpt3_tiny_search", "--results-dir", str(results),
                                      env=slurm_cluster.env).stdout[-3000:]
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps[-1] == 3

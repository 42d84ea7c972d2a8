"""training.runtime=torchtitan at launch (launcher/titan.py): the generated module's context and the job script of
the headline command against golden files (NXDT_UPDATE_GOLDEN=1 rewrites them; review the diff), and every way a
torchtitan launch is refused: one `error:` line naming the key, exit 2, nothing written."""

import json
import os
from pathlib import Path, PurePosixPath

import pytest

from launcher import render as render_module
from launcher import titan
from launcher.launch import build
from launcher.render import render
from runtime.schema.training import parse_training

from .helpers import REPO, nxdt, nxdt_subprocess, refused, resolved

GOLDEN = REPO / "tests" / "golden"
HEADLINE = ["training=llama3/8b", "cluster=pcluster_trn2", "training.runtime=torchtitan"]
LLAMA3_VOCAB = 128256  # Llama 3's tokenizer.json (tests/recipe_data.py writes one of that size)


@pytest.fixture(autouse=True)
def _stable_code_root(monkeypatch):
    monkeypatch.setattr(render_module, "code_root", lambda: PurePosixPath("/opt/nxdt-launch"))


def _golden(name: str, text: str) -> None:
    golden = GOLDEN / name
    if os.environ.get("NXDT_UPDATE_GOLDEN") == "1":
        golden.write_text(text)
    assert golden.exists(), f"no golden file {golden.name}: run with NXDT_UPDATE_GOLDEN=1 and review it"
    assert text.splitlines() == golden.read_text().splitlines()


def test_the_headline_context_matches_golden():
    """stages=[training] training=llama3/8b cluster=pcluster_trn2 training.runtime=torchtitan: Llama 3 8B at the
    trn2 recipe's layout (TP 16 of 64 workers, the other 4 sharding it), the schedule and checkpoints as the recipe
    says. The tokenizer is the cluster's: its size is given as the schema takes a known one (vocab_size)."""
    cfg = resolved("stages=[training]", *HEADLINE)
    config, report = parse_training(cfg["training"], files="warn", prepared=True, vocab_size=LLAMA3_VOCAB)
    assert config is not None, report.errors
    ctx = titan.context(config)
    assert ctx["family"] == "llama3" and ctx["model"]["vocab_size"] == LLAMA3_VOCAB
    assert ctx["parallelism"]["tensor_parallel_degree"] * ctx["parallelism"]["data_parallel_shard_degree"] == 64
    _golden("titan_ctx.training.llama3_8b.pcluster_trn2.json", json.dumps(ctx, indent=2, sort_keys=True) + "\n")


def test_without_the_tokenizer_the_context_leaves_the_vocabulary_to_the_job():
    """A dry run away from the cluster, or data_preparation in the same launch: no tokenizer here."""
    config, vocabulary, errors = titan.typed_config(resolved("stages=[training]", *HEADLINE)["training"])
    assert config is not None and not errors and vocabulary == {"tokenizer": "/data/llama3/tokenizer.json",
                                                                "divisible_by": 128}, vocabulary
    ctx = titan.context(config, vocabulary=vocabulary)
    assert ctx["model"]["vocab_size"] is None and ctx["vocabulary"] == vocabulary


def test_the_headline_module_matches_golden():
    """The generated module of the headline command as the launch writes it: here, without the cluster's tokenizer,
    the job reads the vocabulary from it at start."""
    text = titan.module_text(resolved("stages=[training]", *HEADLINE)["training"])
    compile(text, "training_titan_job.py", "exec")  # valid Python, whatever the values
    assert "tensor_parallel_degree=" in text and "vocab = vocab_size('/data/llama3/tokenizer.json', 128)" in text
    _golden("training_titan_job.llama3_8b.pcluster_trn2.py", text)


def test_the_headline_sbatch_matches_golden():
    cfg = resolved(*HEADLINE)
    job = next(j for j in build({**cfg, "stages": ["training"]}) if j.stage == "training")
    assert job.program == ("-m", "runtime.titan.train", "--job", f"{job.results_dir}/training_titan_job.py")
    moved = job.in_launch("L")  # the module lies beside the launch's stage config (contract 2)
    assert moved.program[-1] == str(moved.config_path.with_name("training_titan_job.py"))
    text = render(job, cfg, executor="slurm", produced_by=f"nxdt-launch {' '.join(HEADLINE)}")
    assert "XLA_USE_BF16" not in text and "neuron_parallel_compile" not in text and "NEURON_LOGICAL_NC_CONFIG=2" in text
    _golden("training.titan_llama3_8b.pcluster_trn2.sh", text)


def test_data_parallelism_shards_within_a_node_and_replicates_across_nodes():
    cfg = resolved("stages=[training]", *HEADLINE, "training.trainer.num_nodes=4")
    config, _ = parse_training(cfg["training"], files="skip", vocab_size=LLAMA3_VOCAB)
    assert titan.data_parallel(config) == {"data_parallel_replicate_degree": 4, "data_parallel_shard_degree": 4}
    # Our hybrid-sharding key is torchtitan's own: where the recipe sets it, the job shards in groups of that many.
    cfg = resolved("stages=[training]", *HEADLINE, "training.trainer.num_nodes=4",
                   "+training.model.data_parallel_shard_degree=8", "training.model.zero_stage=1")
    config, report = parse_training(cfg["training"], files="skip", vocab_size=LLAMA3_VOCAB)
    assert config is not None, report.errors
    assert titan.data_parallel(config) == {"data_parallel_replicate_degree": 2, "data_parallel_shard_degree": 8}
    assert titan.key_problems({"model.data_parallel_shard_degree": 8})[0] == []


@pytest.fixture
def at(tmp_path, recipe_data_dir):
    """A launch here, with every recipe's data, writing under tmp_path/results (which must stay absent)."""
    def launch(*overrides: str, dry_run: bool = True):
        return nxdt(*overrides, f"data_dir={recipe_data_dir}", f"base_results_dir={tmp_path}/results",
                    "cluster_type=local", *(["--dry-run"] if dry_run else []))
    yield launch
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("overrides,expected", [
    (["training=gpt3/tiny"], "training.model.architecture: gpt has no torchtitan counterpart here; the families "
                             "both runtimes share are llama3 and qwen3"),
    (["training=llama3/8b", "cluster=pcluster_trn1"], "training.runtime: torchtitan on Trn1 (cluster.neuron.hardware "
                                                      "trn1): Trn1 has no TorchNeuron"),
    (["training=llama/tiny", "training.model.hidden_dropout=0.1"],
     "training.model.hidden_dropout: 0.1 with training.runtime=torchtitan: torchtitan's models have no dropout"),
    (["training=llama/tiny", "training.model.optim.sched.constant_steps=5"],
     "training.model.optim.sched.constant_steps: 5 with training.runtime=torchtitan: torchtitan's schedule has no "
     "final hold at min_lr"),
    (["training=llama/tiny", "training.precision.type=bf16SR"], "training.precision.type: bf16SR (stochastic "
                                                                 "rounding) has no torchtitan counterpart"),
], ids=["family", "trn1", "dropout", "constant_steps", "precision"])
def test_what_torchtitan_cannot_take_is_refused_in_one_line(at, overrides, expected):
    refused(at("stages=[training]", "training.runtime=torchtitan", *overrides), expected)


def test_a_fine_tuning_stage_refuses_torchtitan(at):
    refused(at("stages=[fine_tuning]", "fine_tuning.runtime=torchtitan"),
            "fine_tuning.runtime: torchtitan runs the training stage (pretraining) only")


def test_a_launch_without_torchtitan_installed_names_the_extra(tmp_path, recipe_data_dir):
    """FAKE: torchtitan is installed here; a sitecustomize on PYTHONPATH sets sys.modules['torchtitan'] = None in the
    CLI's interpreter, which is how Python marks a module as not importable: importlib.util.find_spec (what
    launcher/packages.py asks, importing nothing) then answers as for a missing package. python=null: the job's
    interpreter is the launcher's, the only one whose packages it can judge."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['torchtitan'] = None\n")
    result = nxdt_subprocess("stages=[training]", "training=llama/tiny", "training.runtime=torchtitan", "python=null",
                             "cluster_type=local", f"data_dir={recipe_data_dir}", f"base_results_dir={tmp_path}/out",
                             env={"PYTHONPATH": f"{hide}{os.pathsep}{REPO}"})
    refused(result, "training.runtime: torchtitan needs the torchtitan package, which")
    assert "pip install 'nxdt-launch[torchtitan]'" in result.stderr
    assert not (tmp_path / "out").exists()


def test_the_key_table_names_every_key_of_the_headline_recipe():
    """Every key the recipe composes has its fate in launcher/titan_keys.py: none is refused only for being
    unlisted."""
    from launcher.nxdt_keys import flatten
    from launcher.titan_keys import key_of

    flat = flatten(resolved("stages=[training]", *HEADLINE)["training"])
    assert [key for key in flat if key_of(key) is None] == []
    assert Path(titan.__file__).name == "titan.py"


def test_an_eks_trn2_pod_runs_the_same_program_under_torchneuron():
    from launcher import k8s
    from launcher.config import parse

    cfg = resolved(*HEADLINE, "cluster=eks_trn2", "cluster_type=k8s")
    job = next(j for j in build({**cfg, "stages": ["training"]}) if j.stage == "training")
    manifest = k8s.manifest(job, parse(cfg), produced_by="test")
    assert "-m runtime.titan.train --job" in manifest and "NEURON_LOGICAL_NC_CONFIG=2" in manifest
    assert "neuron_parallel_compile" not in manifest and "XLA_USE_BF16" not in manifest


@pytest.mark.parametrize("name,warmup,min_lr", [("CosineAnnealing", 0, 1e-4), ("LinearAnnealing", 0, 0.0),
                                                ("CosineAnnealing", 7, 1e-4), ("LinearAnnealing", 7, 0.0),
                                                ("Constant", 5, 0.0)])
def test_the_mapped_schedule_against_torchtitans_own(name, warmup, min_lr):
    """Our schedule (NeMo's) and torchtitan's LRSchedulersContainer built from the context's lr_scheduler, step by
    step: the same warmup, the same decay without one, and with one a decay that starts a step later and ends at the
    same step, so that its rate is never above ours a step before nor below ours at the step."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchtitan")
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer

    from runtime.optim_schedule import LRSchedule

    lr, steps = 1e-3, 40
    ours = LRSchedule(name, lr=lr, max_steps=steps, warmup_steps=warmup, min_lr=min_lr)
    cfg = resolved("stages=[training]", *HEADLINE, f"training.trainer.max_steps={steps}",
                   f"training.model.optim.sched.name={name}", f"training.model.optim.sched.warmup_steps={warmup}",
                   f"training.model.optim.sched.min_lr={min_lr}", f"training.model.optim.lr={lr}")
    config, report = parse_training(cfg["training"], files="skip", vocab_size=LLAMA3_VOCAB)
    assert config is not None, report.errors
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    theirs = LRSchedulersContainer.Config(**titan.context(config)["lr_scheduler"]).build(
        optimizers=[optimizer], training_steps=steps)
    for step in range(steps):
        rate = theirs.schedulers[0].get_last_lr()[0]  # the rate torchtitan's step `step` uses
        if step <= warmup or not warmup:
            assert rate == pytest.approx(ours(step), rel=1e-12, abs=1e-15), step
        else:
            assert ours(step) - 1e-15 <= rate <= ours(step - 1) + 1e-15, step
        optimizer.step()
        theirs.step()


def test_a_dry_run_plan_names_what_has_no_effect_in_one_line(tmp_path, recipe_data_dir):
    """The plan of the headline command (its files are written by launch.write, with launcher/titan_module.py):
    the job reads its module from the launch's own directory, and the keys that do nothing there are one warning."""
    from launcher import launch

    plan = launch.make_plan(["stages=[training]", *HEADLINE, f"data_dir={recipe_data_dir}",
                             f"base_results_dir={tmp_path}/results", "cluster_type=slurm"],
                            dry_run=True, produced_by="test")
    (job,) = plan.jobs
    assert job.program[-1] == str(job.config_path.with_name("training_titan_job.py"))
    assert "/launches/" in job.program[-1]
    named = [w for w in plan.warnings if w.startswith("training.runtime=torchtitan: no effect in the torchtitan job")]
    assert len(named) == 1 and "trainer.val_check_interval" in named[0] and "model.init_method_std" in named[0]

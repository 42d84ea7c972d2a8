"""launcher/plain_compose.py and plain_resolve.py against Hydra and OmegaConf (launcher/compose.py), the reference:
every option of every config group in conf/, the clusters that switch a recipe to its layout, and a corpus of
overrides give the same config, unresolved and resolved, value for value, type for type and key for key in order;
whatever the plain composer does not reproduce it refuses (Unsupported), and the launch composes with Hydra."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from launcher import plain_compose, plain_resolve
from launcher.compose import compose, resolve
from launcher.errors import UserError
from launcher.paths import CONFIG_GROUPS, conf_dir, group_choices
from launcher.placeholders import OmegaConfNodes, place, resolve_placed
from launcher.plain_compose import Unsupported

# Every option of every group, in rounds that choose one option of each group (a group with fewer options than the
# training recipes starts again): each option composed at least once, in as few Hydra composes as there are recipes.
CHOICES = {group: group_choices(group) for group in CONFIG_GROUPS}
ROUNDS = [[f"{'+' if group == 'search_config' else ''}{group}={choices[i % len(choices)]}"
           for group, choices in CHOICES.items()] for i in range(max(map(len, CHOICES.values())))]


def _same(overrides: list[str]) -> None:
    """The plain composer gives Hydra's config, unresolved and resolved; repr compares types and key order too."""
    plain = plain_compose.compose(overrides)
    hydra = compose(overrides)
    assert repr(plain) == repr(OmegaConf.to_container(hydra, resolve=False))
    assert repr(plain_resolve.resolve(plain)) == repr(resolve(hydra))


@pytest.mark.parametrize("choices", ROUNDS, ids=lambda r: r[CONFIG_GROUPS.index("training")])
def test_every_option_of_every_group_composes_as_hydra_composes_it(choices):
    _same([*choices, "stages=[data_preparation,training,fine_tuning,peft,alignment,conversion,evaluation]"])


@pytest.mark.parametrize("overrides", [
    ["training=gpt3/175b", "cluster=pcluster_trn1"],       # the recipe's trn1 layout, chosen from the files
    ["training=gpt3/175b", "cluster=pcluster_trn2"],
    ["training=llama3/8b", "cluster=pcluster_trn1n", "stages=[training,conversion]"],
    ["training=llama3/70b", "cluster=slurm"],               # a Trainium recipe's GPU layout
    ["training=gpt3/175b", "cluster=pcluster_trn1", "cluster.neuron.hardware=trn2"],  # the guess is wrong: composed again
    ["training=qwen3/8b", "alignment=llama3/8b", "stages=[alignment]"],  # two recipes override data_preparation
    ["training=llama3/8b", "data_preparation=gpt3/download_pile"],     # the command line over a recipe's override
    ["+search_config=llama3/8b", "cluster=pcluster_trn1"],
], ids=lambda o: " ".join(o))
def test_a_cluster_that_switches_the_recipe_composes_as_hydra_composes_it(overrides):
    _same(overrides)


CORPUS = [
    "training.trainer.max_steps=5", "training.model.optim.lr=1e-4", "training.model.optim.lr=0.5",
    "training.run.name=my_run", "base_results_dir=/fsx/results", "run_name=x-y.z", "stages=[training,conversion]",
    "stages=[]", "+training.model.extra=1", "++training.trainer.max_steps=7", "++training.new.deep.key=null",
    "env_vars.NCCL_DEBUG=INFO", "cluster.env_vars.FI_PROVIDER=efa", "container=null", "training.trainer.devices=-1",
    "training.model.tokenizer.model=/data/tok.model", "+training.model.flags=[a,b,1,2.5,true]", "dry_run=true",
    "training.run.name=${cluster_type}", "training.run.name='a b'", "training.run.name=\"x y\"", "container=''",
    "training.model.tokenizer.model='${data_dir}/t k.json'", "++cluster.neuron.compile.cache='--a b=1'",
]


# Files given as a choice (launcher/nxdt_config.py maps them) that the plain composer composes: their configs are
# kept for the compose instead of in Hydra's ConfigStore (launcher/cache.py). The others it leaves to Hydra (a
# list merged over an interpolation, a recipe switched by `targets`): test_nxdt_config launches every file.
FILES = [("training", "hf_llama3.1_8B_config"), ("training", "hf_mixtral_8x7b_config"),
         ("fine_tuning", "hf_llama3_8B_SFT_config"), ("peft", "hf_llama3_8B_SFT_lora_config"),
         ("alignment", "hf_llama3_8B_DPO_config"), ("fine_tuning", "megatron_llama2_7B_SFT_config")]


@pytest.mark.parametrize("stage,name", FILES, ids=[name for _, name in FILES])
def test_a_file_launch_composes_as_hydra_composes_it_and_leaves_no_choice_behind(stage, name):
    from launcher import cache
    from launcher.plain_compose import registered_choices

    file = Path(__file__).parents[1] / "fixtures" / "nxdt" / f"{name}.yaml"
    overrides = ["cluster=pcluster_trn1", "cluster_type=slurm", "data_dir=/data", "base_results_dir=/fsx/results",
                 f"stages=[{stage}]", f"{stage}=@{file}"]
    plain_warnings, hydra_warnings = [], []
    plain = cache._without_hydra(overrides, plain_warnings)
    assert not registered_choices()
    assert repr(plain) == repr(resolve(compose(overrides, hydra_warnings)))
    assert plain_warnings == hydra_warnings


@pytest.mark.parametrize("override", CORPUS)
def test_overrides_of_the_simple_forms_apply_as_hydra_applies_them(override):
    _same(["training=gpt3/126m", "stages=[training]", override])


REFUSED = [
    "~training.run", "training.trainer.max_steps=1,2", "training.run.name='a\\'b'", "training.run.name='${run_name'",
    "training.run.name=", "training=gpt3/tny", "training=../conf/training/gpt3/tiny", "hydra.job.chdir=true",
    "training.model.tensor_model_paralel_size=2", "+training.trainer.max_steps=5", "training.trainer=5",
    "training.model.optim.lr=1_0", "training.model.optim.lr=.5", "training.run.name=True", "run_name=nan",
    "training@x=gpt3/tiny", "training.trainer.max_steps=5 ", "training.model=[1]", "+cluster=slurm",
    "stages=[training,[a]]", "env_vars={A: 1}", "training=@/tmp/nxdt.yaml",
]


@pytest.mark.parametrize("override", REFUSED)
def test_what_the_plain_composer_does_not_reproduce_it_leaves_to_hydra(override):
    with pytest.raises(Unsupported):
        plain_compose.compose(["stages=[training]", override])


def test_the_switch_composes_every_launch_with_hydra(monkeypatch):
    monkeypatch.setenv(plain_compose.SWITCH, "hydra")
    with pytest.raises(Unsupported):
        plain_compose.compose([])


def test_every_conf_file_reads_as_omegaconf_reads_it():
    files = plain_compose.Files()
    for path in sorted(conf_dir().rglob("*.yaml")):
        name = str(path.relative_to(conf_dir()).with_suffix(""))
        expected = OmegaConf.to_container(OmegaConf.load(path))
        try:
            config, defaults = files.load(name)
        except Unsupported:
            assert name.startswith("pcluster/"), name  # `???` values: the cluster-config command's, Hydra's
            continue
        assert repr({**({"defaults": defaults} if "defaults" in expected else {}), **config}) == repr(
            {"defaults": expected.pop("defaults"), **expected} if "defaults" in expected else expected)


@pytest.mark.parametrize("text", [
    "a: 1e-5", "a: 1.5e5", "a: -3", "a: +4", "a: 0.25", "a: 1_000", "a: 0x1f", "a: 017", "a: 1:30", "a: .inf",
    "a: .5", "a: 2024-01-01", "a: yes", "a: ~", "a: 1.2.3", "a: '1e5'", "a: [1, b]", "a: &x {b: 1}\nc: *x",
    "a: 1\na: 2", "a: ???", "a: -.5", "a: 175b", "a: 0",
])
def test_yaml_scalars_read_as_omegaconf_reads_them_or_are_left_to_it(tmp_path, monkeypatch, text):
    (tmp_path / "config.yaml").write_text(text + "\n")
    monkeypatch.setenv("NXDT_CONF_DIR", str(tmp_path))
    try:
        expected = OmegaConf.to_container(OmegaConf.load(tmp_path / "config.yaml"))
    except Exception:
        expected = None
    try:
        config, _ = plain_compose.Files().load("config")
    except Unsupported:
        assert text.split(": ", 1)[1] not in ("1e-5", "1.5e5", "-3", "+4", "0.25", "yes", "~", "[1, b]"), text
        return
    assert expected is not None and repr(config) == repr(expected)


def test_interpolations_resolve_as_omegaconf_resolves_them():
    cfg = {"x": 8, "f": 0.5, "s": "ab", "n": None, "stages": ["training"], "training": {"run": {"name": "r"}},
           "a": "${multiply:4, ${.x}}", "b": "x${f}y${x}${n}", "c": "${cwd:}", "d": "${s}", "e": "${trained:run.name}",
           "g": {"lr": 2.0, "h": {"min": "${multiply:${..lr},0.1}", "up": "${..lr}", "same": "${.min}"}},
           "i": "${divide_ceil:${x},3}/${divide_floor:7,2}", "j": "${trained_here:run.name}"}
    from launcher.resolvers import register_resolvers

    register_resolvers()
    assert repr(plain_resolve.resolve(cfg)) == repr(OmegaConf.to_container(OmegaConf.create(cfg), resolve=True))
    # ${shared_dir:NAME}: the working directory's, or on k8s the shared volume's (its mount path an interpolation).
    for kind in ("local", "k8s"):
        cfg = {"cluster_type": kind, "root": "/fsx", "cluster": {"k8s": {"volume": {"mount_path": "${root}"}}},
               "r": "${shared_dir:results}"}
        assert plain_resolve.resolve(cfg)["r"] == OmegaConf.to_container(OmegaConf.create(cfg), resolve=True)["r"] \
            == ("/fsx/results" if kind == "k8s" else f"{os.getcwd()}/results")


@pytest.mark.parametrize("value", ["${oc.env:HOME}", "${missing}", "${g}", "\\${x}", "${x", "${a}", "${ x }",
                                   "${multiply:'1',2}", "${.g.h}"])
def test_an_interpolation_outside_the_forms_is_left_to_omegaconf(value):
    with pytest.raises(Unsupported):
        plain_resolve.resolve({"x": 1, "g": {"h": 1}, "a": "${b}", "b": "${a}", "v": value})


@pytest.mark.parametrize("overrides", [
    ["stages=[training]", "training=gpt3/175b"],
    ["stages=[fine_tuning,conversion]", "fine_tuning=llama3/8b", "cluster=pcluster_trn2"],
])
def test_placeholders_are_placed_and_resolved_as_with_hydra(overrides):
    from launcher.resolvers import recording_env

    results = []
    for nodes in (plain_resolve.PlainNodes(plain_compose.compose(overrides)),
                  OmegaConfNodes(compose(overrides), resolve)):
        with recording_env() as env_reads:
            placed = place(nodes, "salt")
            results.append((placed, resolve_placed(nodes, placed, env_reads)))
    assert results[0][0] is not None and results[0][1] is not None
    assert repr(results[0]) == repr(results[1])


def test_a_mistake_the_plain_composer_meets_is_named_by_hydra():
    for mistake in ("training=gpt3/tny", "training.model.tensor_model_paralel_size=2"):
        with pytest.raises(Unsupported):
            plain_compose.compose([mistake])
        with pytest.raises(UserError):
            compose([mistake])


def test_no_hydra_or_omegaconf_is_imported(tmp_path):
    import subprocess
    import sys

    code = ("import sys; from launcher import plain_compose, plain_resolve; "
            "plain_resolve.resolve(plain_compose.compose(['training=gpt3/175b', 'cluster=pcluster_trn1'])); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('hydra', 'omegaconf', 'antlr4')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_file_launch_leaves_no_choice_behind_for_the_next_compose():
    """The choices a training=@FILE compose stores in Hydra's ConfigStore are its own: afterwards the process's
    ConfigStore holds none, so the next compose is the plain one again (and cannot see the file's choices)."""
    from hydra.core.config_store import ConfigStore

    from launcher.plain_compose import registered_choices
    from tests.launcher.test_nxdt_config import FIXTURES

    cfg = compose([f"training=@{FIXTURES / 'hf_llama3_8B_config.yaml'}", "cluster=pcluster_trn1"])
    assert cfg.training.run.name == "hf_llama"  # the file's
    assert not registered_choices() and not set(CONFIG_GROUPS) & set(ConfigStore.instance().repo)

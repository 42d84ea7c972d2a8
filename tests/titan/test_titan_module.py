"""launcher/titan_module.py renders the job context into a module a torchtitan user recognizes (nxdt_job() ->
Trainer.Config, every value the context's, by repr); runtime/titan/model.py builds the recipe's shape with
torchtitan's builders; runtime.titan.train refuses a missing torchtitan or job in one line, exit 2."""
import ast
import copy
import os
import sys
from pathlib import Path

import pytest

from launcher.titan_module import render_module
from tests.titan.conftest import CONTEXT


def ctx(**sections) -> dict:
    value = copy.deepcopy(CONTEXT)
    value["data"]["blend"] = [[1.0, "/data/it's \"quoted\"\n# not code"]]
    value["dump_folder"] = "/results/run"
    for section, values in sections.items():
        value[section].update(values)
    return value


GOLDEN = Path(__file__).parent / "golden" / "training_titan_job.py.golden"


def test_the_module_matches_its_golden_file():
    """Changes to the job module only on purpose: NXDT_UPDATE_GOLDEN=1 rewrites the golden file (then review it)."""
    value = ctx()
    value["data"]["blend"] = [[2.0, "/data/wiki_text_document"], [1.0, "/data/code_text_document"]]
    text = render_module(value)
    if os.environ.get("NXDT_UPDATE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(text)
    assert GOLDEN.exists(), f"no golden file {GOLDEN.name}: run with NXDT_UPDATE_GOLDEN=1 and review it"
    assert text.splitlines() == GOLDEN.read_text().splitlines()


def test_the_module_is_readable_python_whose_values_are_the_contexts():
    text = render_module(ctx())
    assert text == render_module(ctx())  # pure
    assert text.startswith("# torchtitan job of the nxdt-launch launch tests/titan (a hand-written context).")
    tree = ast.parse(text)  # a path with quotes and a newline stays one string literal
    (function,) = [node for node in tree.body if isinstance(node, ast.FunctionDef)]
    assert function.name == "nxdt_job" and ast.unparse(function.returns) == "Trainer.Config"
    keywords = {k.arg: k.value for node in ast.walk(function) if isinstance(node, ast.Call)
                for k in node.keywords if k.arg}
    assert ast.literal_eval(keywords["blend"]) == [(1.0, "/data/it's \"quoted\"\n# not code")]
    assert ast.literal_eval(keywords["dump_folder"]) == "/results/run"
    assert ast.literal_eval(keywords["optimizer_kwargs"]) == {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8,
                                                              "weight_decay": 0.1}
    for key in ("local_batch_size", "seq_len", "steps", "data_parallel_shard_degree", "log_freq", "seed",
                "init_timeout_seconds", "warmup_steps", "interval", "dim", "n_kv_heads", "norm_eps"):
        assert key in keywords, key
    assert ast.literal_eval(keywords["norm_eps"]) == 1e-5 and ast.literal_eval(keywords["seed"]) == 1234
    assert ast.unparse(keywords["activation_checkpoint"]) == "None"
    # None in the context: torchtitan's default, named in the closing comment and not passed.
    assert "decay_ratio" not in keywords and "lr_scheduler.decay_ratio" in text.split("# Left to torchtitan")[1]


@pytest.mark.parametrize("choice, code", [("full", "FullAC.Config()"), ("selective", "SelectiveAC.Config()")])
def test_activation_checkpointing_is_torchtitans_policy(choice, code):
    value = ctx()
    value["activation_checkpoint"] = choice
    assert f"activation_checkpoint={code}," in render_module(value)


@pytest.mark.parametrize("change, message", [
    (lambda c: c.pop("data"), "missing data"),
    (lambda c: c.update(family="gpt"), "family: 'gpt' is not one torchtitan trains here"),
    (lambda c: c["training"].update(micro_batch_size=1), "training has no key micro_batch_size"),
    (lambda c: c.update(activation_checkpoint="some"), "activation_checkpoint: 'some'"),
])
def test_a_context_it_cannot_render_whole_is_a_value_error(change, message):
    value = ctx()
    change(value)
    with pytest.raises(ValueError, match=message):
        render_module(value)


def test_the_rendered_job_builds_the_contexts_model_and_config(tmp_path, monkeypatch):
    pytest.importorskip("torchtitan", reason="torchtitan is the optional extra nxdt-launch[torchtitan]")
    from runtime.titan.train import load_job

    value = ctx()
    value["family"] = "qwen3"
    value["model"].update(vocab_size=96, head_dim=16, qk_norm=False, tie_embeddings=True, norm_eps=1e-6)
    path = tmp_path / "training_titan_job.py"
    path.write_text(render_module(value))
    monkeypatch.setitem(sys.modules, "rendered_job", None)  # load_job registers the module; removed after
    module = load_job(path, "rendered_job")
    assert sys.modules["rendered_job"] is module
    config = module.nxdt_job()
    model = config.model_spec.model
    assert config.model_spec.name == "qwen3" and model.vocab_size == 96 and model.enable_weight_tying
    assert len(model.layers) == 2 and model.layers[0].attention.qk_norm is None
    assert model.layers[0].attention.head_dim == 16 and model.norm.eps == 1e-6
    assert config.training.seq_len == 16 and config.parallelism.spmd_backend == "partial_dtensor"
    assert config.dataloader.global_batch_size == 4 and config.dataloader.steps == 4
    assert config.checkpoint.last_save_model_only is False and config.debug.seed == 1234


def test_a_missing_torchtitan_is_one_line_naming_the_extra(tmp_path, monkeypatch, capsys):
    from runtime.titan import train

    job = tmp_path / "training_titan_job.py"
    job.write_text(render_module(ctx()))
    monkeypatch.setitem(sys.modules, "torchtitan.train", None)  # import torchtitan.train raises ImportError
    assert train.main(["--job", str(job)]) == 2
    err = capsys.readouterr().err
    assert "pip install 'nxdt-launch[torchtitan]'" in err and err.count("\n") == 1


def test_a_missing_job_is_one_line(tmp_path, capsys):
    from runtime.titan import train

    assert train.main(["--job", str(tmp_path / "nothing.py")]) == 2
    err = capsys.readouterr().err
    assert "--job: no file" in err and err.count("\n") == 1

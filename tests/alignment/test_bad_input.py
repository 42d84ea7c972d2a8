"""Mistakes in an alignment launch: one line naming the key (or the file:line), the same from the launcher's real
launch and from the trainer loading the config on the node, before anything is written or submitted."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launcher import launch
from runtime.alignment.synthetic import write_demo
from tests.schema.test_rules_table import _launcher_errors, _runtime_errors

REPO = Path(__file__).resolve().parents[2]
A = "alignment."
S = "alignment.model_alignment_strategy.dpo."


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    data = tmp_path_factory.mktemp("data")
    demo = data / "preference_demo"
    write_demo(demo, num_train=32, num_valid=8, num_test=8, seed=5)
    lines = (demo / "train.jsonl").read_text().splitlines()
    broken = [json.loads(line) for line in lines]
    del broken[2]["chosen"]
    (demo / "no_chosen.jsonl").write_text("\n".join(json.dumps(r) for r in broken) + "\n")
    long_prompt = [json.loads(line) for line in lines[:4]]
    long_prompt[3]["prompt"] = "reverse: " + " ".join(["cat dog sun"] * 40)
    (demo / "long_prompt.jsonl").write_text("\n".join(json.dumps(r) for r in long_prompt) + "\n")
    return data


CASES = [
    ([f"{S}kl_beta=0"],
     "alignment.model_alignment_strategy.dpo.kl_beta: 0.0 must be > 0 (how strongly the policy is held to the "
     "reference; NxD Training's recipes use 0.01-0.1)"),
    ([f"{S}max_dpo_prompt_length=128"],
     "alignment.model_alignment_strategy.dpo.max_dpo_prompt_length: 128 leaves no room for the response in a row of "
     "seq_length 128; set it below seq_length (half of it is usual)"),
    ([f"{S}precompute_ref_log_probs=false"],
     "alignment.model_alignment_strategy.dpo.precompute_ref_log_probs: false trains every weight, so the reference "
     "would be a second model in memory; set it to true (computed once before training) or use LoRA "
     "(model.peft.peft_scheme=lora)"),
    ([f"{A}model.context_parallel_size=2"],
     "alignment.model.context_parallel_size: a context group of 2 ranks in the alignment stage"),
    ([f"+{A}model.data.packing=true"],
     "alignment.model.data.packing: true in the alignment stage: each pair is its own two rows"),
    ([f"+{A}model.data.identical_pairs=warn"],
     "alignment.model.data.identical_pairs: 'warn' is not one of error, drop"),
    ([f"{A}model.data.train_ds.file_names=[${{data_dir}}/preference_demo/no_chosen.jsonl]"],
     "no_chosen.jsonl:3:"),
    ([f"{S}truncation_mode=keep_end", f"{S}max_dpo_prompt_length=32",
      f"{A}model.data.train_ds.file_names=[${{data_dir}}/preference_demo/long_prompt.jsonl]"],
     "long_prompt.jsonl:4: the prompt is"),
]


@pytest.mark.parametrize("overrides,line", CASES, ids=[c[1].split(":")[0].split("/")[-1] + f"-{i}"
                                                       for i, c in enumerate(CASES)])
def test_each_mistake_is_one_line_at_launch_and_on_the_node(overrides, line, data_dir, tmp_path, capsys):
    overrides = ["stages=[alignment]", "alignment=llama/tiny_dpo", "cluster_type=local", f"data_dir={data_dir}",
                 f"base_results_dir={tmp_path / 'results'}", *overrides]
    real = _launcher_errors(overrides, tmp_path, dry_run=False)
    node = _runtime_errors(overrides, tmp_path, capsys, "alignment")
    assert len(real) == 1 and line in real[0], real
    assert len(node) == 1 and line in node[0], node
    assert real == node
    assert not (tmp_path / "results").exists()
    if "file_names" not in " ".join(overrides):
        assert any(line in p for p in _launcher_errors(overrides, tmp_path, dry_run=True))


def test_the_keep_end_line_names_the_limit_and_the_fixes(data_dir, tmp_path):
    overrides = ["stages=[alignment]", "alignment=llama/tiny_dpo", "cluster_type=local", f"data_dir={data_dir}",
                 f"base_results_dir={tmp_path / 'results'}", f"{S}truncation_mode=keep_end",
                 f"{S}max_dpo_prompt_length=32",
                 f"{A}model.data.train_ds.file_names=[{data_dir}/preference_demo/long_prompt.jsonl]"]
    (problem,) = _launcher_errors(overrides, tmp_path, dry_run=False)
    assert "max_dpo_prompt_length=32" in problem and "keep_start" in problem, problem
    # keep_start cuts the same prompt instead: the launch goes through.
    launch.make_plan([*overrides[:-3], f"{S}max_dpo_prompt_length=32", overrides[-1]], dry_run=True,
                     produced_by="test")


# A head node with the launcher's dependencies and tokenizers, but no numpy or torch.
HEAD_NODE_LAUNCH = """
import importlib.abc, json, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'numpy'):
            raise ImportError(f'{name} is not installed on this head node')
sys.meta_path.insert(0, Block())
from launcher import launch
from launcher.errors import UserError
try:
    launch.make_plan(json.loads(sys.argv[1]), dry_run=False, produced_by="test")
except UserError as error:
    print(json.dumps(error.problems))
"""


def test_the_keep_end_check_needs_neither_numpy_nor_torch(data_dir, tmp_path):
    """Counting the prompt's tokens needs the tokenizers library and nothing else of the runtime's: the launch
    refuses the same prompt with the same line on a head node without numpy or torch."""
    overrides = ["stages=[alignment]", "alignment=llama/tiny_dpo", "cluster_type=local", f"data_dir={data_dir}",
                 f"base_results_dir={tmp_path / 'results'}", f"{S}truncation_mode=keep_end",
                 f"{S}max_dpo_prompt_length=32",
                 f"{A}model.data.train_ds.file_names=[{data_dir}/preference_demo/long_prompt.jsonl]"]
    result = subprocess.run([sys.executable, "-c", HEAD_NODE_LAUNCH, json.dumps(overrides)], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    # (The launch also says that the local jobs' Python lacks torch and numpy: it is this one, blocked.)
    head_node = [line for line in json.loads(result.stdout) if "needs the" not in line]
    assert head_node == _launcher_errors(overrides, tmp_path, dry_run=False)
    assert "long_prompt.jsonl:4: the prompt is" in head_node[0]
    assert not (tmp_path / "results").exists()

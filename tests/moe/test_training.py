"""mixtral/tiny as the launcher configures it on this machine: four CPU workers train it with its experts split over two
expert-parallel ranks and two tensor-parallel ranks (ep=2 x tp=2, sequence parallel), the loss falls, metrics.jsonl
carries the MoE layers' auxiliary loss, dropped share and load imbalance every logged step, and the conversion
stage merges the expert shards into a MixtralForCausalLM that transformers runs to the same logits."""
import json

import pytest
import torch

from runtime.checkpoint import full_tensors, read_config, read_rank_files, resolve_checkpoint
from runtime.config import parse_model_config
from runtime.models import build_model

from tests.checkpoint.launch_helpers import convert_rendered, counting_corpus, train_rendered, training_overrides
from tests.launcher.helpers import nxdt


@pytest.mark.slow
def test_mixtral_tiny_trains_and_reports_its_experts(tmp_path):
    data = counting_corpus(tmp_path / "data")
    overrides = training_overrides(data, tmp_path / "results", steps=20, every=0, hidden=64,
                                   extra=("training=mixtral/tiny", "training.run.name=moe",
                                          "training.model.moe.router_aux_loss_coef=0.05", "training.trainer.devices=4",
                                          "training.model.tensor_model_parallel_size=2",
                                          "training.model.expert_model_parallel_size=2",
                                          "training.model.sequence_parallel=true"))
    # The launcher renders the run (--dry-run) and its four ranks are forked from this process: mixtral/tiny's
    # launch through torchrun is tests/test_pipeline.py's (on two Slurm nodes).
    result = nxdt("cluster_type=local", *overrides, "--dry-run", cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    config = tmp_path / "results" / "moe" / "training" / "training_config.yaml"
    assert train_rendered(config) == [0] * 4
    rows = [json.loads(line) for line in (tmp_path / "results" / "moe" / "training" / "metrics.jsonl")
            .read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 21))
    for row in steps:
        assert row["moe_tokens_dropped"] == 0.0  # dropless
        assert 1.0 <= row["moe_load_imbalance"] <= 4.0  # busiest expert over the mean, of 4 experts
        assert row["moe_aux_loss"] > 0
    # Two MoE layers, each about 0.05 * top_k (= 0.1) when balanced: their sum near 0.2 (more if unbalanced).
    assert 0.15 < steps[-1]["moe_aux_loss"] < 0.5, steps[-1]
    assert steps[-1]["loss"] < steps[0]["loss"] - 1.0, [r["loss"] for r in steps]

    transformers = pytest.importorskip("transformers")
    # The conversion stage as the launcher configures it, its command run in this process (convert_rendered).
    export = [o.replace("stages=[training]", "stages=[conversion]") for o in overrides]
    convert_rendered(export, tmp_path, tmp_path / "results" / "moe" / "conversion")
    hf_dir = tmp_path / "results" / "moe" / "conversion" / "hf_model"
    assert json.loads((hf_dir / "config.json").read_text())["architectures"] == ["MixtralForCausalLM"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32,
                                                           experts_implementation="eager").eval()
    storage, checkpoint = resolve_checkpoint(str(tmp_path / "results" / "moe" / "training" / "checkpoints"))
    training = read_config(storage, checkpoint)
    ours = build_model(parse_model_config(training["model"], training["model"]["tokenizer"]["model"])).eval()
    full = full_tensors(read_rank_files(storage, checkpoint.name))
    ours.load_state_dict({name: full.get(name, "value") for name in ours.state_dict()})
    ids = torch.randint(1, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = hf(ids).logits, ours(ids)
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5), (got - expected).abs().max()

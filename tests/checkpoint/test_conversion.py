# The conversion stage through the launcher: a checkpoint trained under tp=2 (GPT) or pp=2 (Llama) exports to a
# Hugging Face directory that transformers loads with the runtime's logits, and HF -> runtime -> HF is lossless.
# Each conversion is the stage as the launcher configures it (its rendered script's command), run in the test
# process (launch_helpers.convert_rendered): the stage's script itself runs in tests/test_pipeline.py.
import json

import pytest
import torch

from runtime.checkpoint import full_tensors, read_config, read_rank_files, resolve_checkpoint
from runtime.config import parse_model_config
from runtime.models import build_model
from tests.checkpoint.launch_helpers import convert_rendered, counting_corpus, train_rendered, training_overrides
from tests.launcher.helpers import nxdt

LAYOUTS = {"gpt3/tiny": ["training.model.tensor_model_parallel_size=2"],
           "llama/tiny": ["training.model.pipeline_model_parallel_size=2", "training.model.zero1=true"]}


def _runtime_logits(checkpoint_dir, ids):
    storage, checkpoint = resolve_checkpoint(str(checkpoint_dir))
    training = read_config(storage, checkpoint)
    model = build_model(parse_model_config(training["model"], training["model"]["tokenizer"]["model"])).eval()
    full = full_tensors(read_rank_files(storage, checkpoint.name))
    model.load_state_dict({name: full.get(name, "value") for name in model.state_dict()})
    with torch.no_grad():
        return model(ids)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", sorted(LAYOUTS))
@pytest.mark.long("trains, exports, loads the export in transformers and converts it back, per architecture")
def test_export_loads_in_transformers_and_round_trips(tmp_path, recipe):
    transformers = pytest.importorskip("transformers")
    data = counting_corpus(tmp_path / "data")
    train = training_overrides(data, tmp_path / "results", steps=4, every=0,
                               extra=(f"training={recipe}", "training.run.name=tiny", *LAYOUTS[recipe]))
    # The checkpoint to export: trained from the launcher's rendered config in two ranks forked from this process
    # (what is under test is the export of a sharded checkpoint, not the launch of its training).
    result = nxdt("cluster_type=local", *train, "--dry-run", cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    config = tmp_path / "results" / "tiny" / "training" / "training_config.yaml"
    assert train_rendered(config) == [0, 0]

    export = [o.replace("stages=[training]", "stages=[conversion]") for o in train]
    convert_rendered(export, tmp_path, tmp_path / "results" / "tiny" / "conversion")
    hf_dir = tmp_path / "results" / "tiny" / "conversion" / "hf_model"
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in hf_dir.iterdir()}

    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    ids = torch.randint(1, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hf_logits = hf(ids).logits
    ours = _runtime_logits(tmp_path / "results" / "tiny" / "training" / "checkpoints", ids)
    assert (hf_logits - ours).abs().max().item() <= 1e-4
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    assert tokenizer("w1 w2 w3")["input_ids"]

    # HF -> runtime checkpoint -> HF again: every tensor bitwise equal.
    imported = tmp_path / "imported"
    back = [*export, "conversion.mode=import", f"conversion.hf_checkpoint_dir={hf_dir}",
            f"conversion.checkpoint_dir={imported}"]
    convert_rendered(back, tmp_path, tmp_path / "results" / "tiny" / "conversion")
    again = [*export, f"conversion.checkpoint_dir={imported}", f"conversion.output_dir={tmp_path / 'again'}"]
    convert_rendered(again, tmp_path, tmp_path / "results" / "tiny" / "conversion")
    from safetensors.torch import load_file
    first, second = load_file(hf_dir / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    # A conversion alone exports with the tokenizer its checkpoint recorded: the imported model's own.
    assert json.loads((tmp_path / "again" / "nxdt_export.json").read_text())["tokenizer"] == str(
        hf_dir / "tokenizer.json")
    assert json.loads((hf_dir / "config.json").read_text())["vocab_size"] == first[next(
        k for k in first if "wte" in k or "embed_tokens" in k)].shape[0]

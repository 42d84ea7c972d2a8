"""Checkpoints both ways with torchtitan 0.3.0's DCP (runtime/convert/titan.py), on tiny llama3 and qwen3 models:

- ours -> DCP -> ours is bitwise: weights, Adam moments, the optimizer step, the step and the data position, from
  checkpoints saved at tp1, tp2 and pp2 (two gloo ranks);
- torchtitan's own CheckpointManager loads the DCP into its model, optimizer container, LambdaLR and a dataloader
  holding {"consumed_samples": N}; torchtitan's model computes our runtime's logits (fp32, <= 1e-5 relative) on the
  weights converted from every source (llama3 and qwen3, tp1, tp2, pp2) and with Llama 3.1's RoPE scaling, with its
  default FlexAttention and block-causal mask, on the CPU, unpatched;
- bad inputs (another family, a checkpoint not matching the named model config, a missing or corrupt DCP): one
  `error:` line, exit 2, nothing written.
"""
from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
import yaml
from torch.distributed.checkpoint.stateful import Stateful

pytest.importorskip("torchtitan")

from runtime.checkpoint import full_tensors, read_rank_files, resolve_checkpoint  # noqa: E402
from runtime.convert.__main__ import main as convert_main  # noqa: E402
from runtime.convert.titan import read_dcp  # noqa: E402
from runtime.convert.titan_model import TitanModel, titan_family  # noqa: E402
from runtime.models import build_model  # noqa: E402
from tests.convert import titan_harness as TH  # noqa: E402

KEYS = ("value", "exp_avg", "exp_avg_sq")


def _ours(location):
    storage, checkpoint = resolve_checkpoint(str(location))
    files = read_rank_files(storage, checkpoint)
    header = next(f for f in files if f["rank"] == 0)
    full = full_tensors(files)
    tensors = {(n, k): full.get(n, k) for n in full.names() for k in KEYS if full.has(n, k)}
    return tensors, int(header["optim_scalars"]["step"]), header["extra"]["step"], header["extra"]["data"]


def _round_trip(tmp_path, source, family):
    folder, back = tmp_path / "titan", tmp_path / "back"
    assert convert_main(["to-titan", "--checkpoint", str(source), "--folder", str(folder)]) == 0
    config = tmp_path / "training.yaml"
    config.write_text(yaml.safe_dump({"model": TH.model_section(family, str(tmp_path / "tokenizer.json"))}))
    step_dir = folder / "step-2"
    assert convert_main(["from-titan", "--dcp", str(step_dir), "--config", str(config),
                         "--checkpoint-dir", str(back)]) == 0
    return step_dir, config, back


@pytest.mark.parametrize("family,tp,pp", [("llama3", 1, 1), ("qwen3", 1, 1), ("llama3", 2, 1), ("qwen3", 1, 2)])
def test_ours_to_dcp_and_back_is_bitwise(tmp_path, family, tp, pp):
    source = TH.our_checkpoint(tmp_path, family, tp, pp)
    step_dir, _, back = _round_trip(tmp_path, source, family)
    before, after = _ours(source), _ours(back)
    assert set(before[0]) == set(after[0])
    for key, tensor in before[0].items():
        assert torch.equal(tensor, after[0][key]), key
    assert before[1:] == after[1:] == (2, 2, {"consumed_samples": TH.CONSUMED})
    flat = read_dcp(step_dir)
    assert flat["train_state.step"] == 2 and flat["lr_scheduler.last_epoch"] == 2
    assert flat["dataloader.consumed_samples"] == TH.CONSUMED
    assert flat["optimizer.state.layers.0.attention.qkv_linear.wqkv.weight.step"].item() == 2
    # torchtitan's own model on the converted weights computes our logits, whatever layout saved them.
    cfg = TH.model_config(family)
    titan = _initialized(TitanModel(cfg, titan_family(cfg, "test")))
    titan.model.load_state_dict({key: flat[key] for key in titan.state_keys()})
    _same_logits(cfg, titan.model, {n: t for (n, k), t in before[0].items() if k == "value"})


def _initialized(titan: TitanModel) -> TitanModel:
    """Its buffers (the RoPE cache) computed; init_states also draws weights, which the caller then replaces."""
    with torch.no_grad():
        titan.model.init_states(buffer_device=torch.device("cpu"))
    return titan


def _same_logits(cfg, titan_model, ours: dict) -> None:
    """torchtitan's model (FlexAttention, its block-causal mask over positions 0..L-1: one causal block per row, as
    ours) and ours on the same weights and tokens: logits equal within 1e-5 relative (fp32)."""
    runtime = build_model(cfg).eval()
    runtime.load_state_dict({n: ours[n] for n in runtime.state_dict()})
    ids = torch.randint(0, TH.VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        expected = runtime(ids).float()
        got = titan_model.eval()(ids, positions, titan_model.get_attention_masks(positions))
    assert ((got - expected).abs().max() / expected.abs().max()).item() <= 1e-5


def test_llama31_rope_scaling_gives_our_logits():
    """Llama 3.1's RoPE scaling (rope_type llama3) is torchtitan's "llama" scaling: a context of 16 over an original 4
    stretches every wavelength class, and the logits still agree."""
    from runtime.schema.model import RopeScaling

    cfg = dataclasses.replace(TH.model_config("llama3"), rope_scaling=RopeScaling(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=4))
    torch.manual_seed(0)
    ours = {n: t.detach().clone() for n, t in build_model(cfg).state_dict().items()}
    titan = _initialized(TitanModel(cfg, titan_family(cfg, "test")))
    titan.model.load_state_dict(titan.checkpoint_state(ours))
    _same_logits(cfg, titan.model, ours)


class _Data(Stateful):
    """nxdt's dataloader for torchtitan as the checkpoint sees it (contract 3): {"consumed_samples": N}."""

    consumed_samples = 0

    def state_dict(self):
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state):
        self.consumed_samples = int(state["consumed_samples"])


def test_torchtitan_loads_it_and_computes_our_logits(tmp_path):
    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer

    family = "llama3"
    source = TH.our_checkpoint(tmp_path, family)
    assert convert_main(["to-titan", "--checkpoint", str(source), "--folder", str(tmp_path / "titan")]) == 0
    cfg = TH.model_config(family)
    titan = TitanModel(cfg, titan_family(cfg, "test"))  # FlexAttention, torchtitan's default backend
    model = titan.model
    with torch.no_grad():
        model.init_states(buffer_device=torch.device("cpu"))  # its RoPE cache (weights come from the checkpoint)
        for p in model.parameters():
            p.zero_()
    group = ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1.0})
    optimizers = OptimizersContainer.Config(param_groups=[group], implementation="for-loop").build(
        model_parts=[model])
    schedulers = LRSchedulersContainer(optimizers, lambda _: 1.0)
    data, train_state = _Data(), _TrainState()
    manager = CheckpointManager(CheckpointManager.Config(enable=True, folder="titan"), dataloader=data,
                                model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
                                states={"train_state": train_state}, sd_adapter=None, base_folder=str(tmp_path))
    assert manager.load() is True
    manager.close()
    assert (train_state.step, data.consumed_samples, schedulers.schedulers[0].last_epoch) == (2, TH.CONSUMED, 2)
    ours, _, _, _ = _ours(source)
    fused = optimizers.optimizers[0].state[model.layers["0"].attention.qkv_linear.wqkv.weight]["exp_avg"]
    assert fused.abs().sum() > 0 and optimizers.optimizers[0].param_groups[0]["lr"] != 1.0  # ours: 1e-3

    runtime = build_model(cfg).eval()
    runtime.load_state_dict({n: ours[(n, "value")] for n in runtime.state_dict()})
    ids = torch.randint(0, TH.VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = runtime(ids).float()
        # torchtitan's default: FlexAttention under its block-causal mask from per-document positions (one
        # document per row here, so causal, as ours); its CPU forward runs as shipped.
        positions = torch.arange(ids.shape[1]).expand_as(ids)
        got = model.eval()(ids, positions, model.get_attention_masks(positions))
    assert ((got - expected).abs().max() / expected.abs().max()).item() <= 1e-5


class _TrainState(Stateful):
    step, ntokens_seen = 0, 0

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state):
        self.step, self.ntokens_seen = state["step"], state["ntokens_seen"]


def _refused(capsys, argv, written):
    assert convert_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert not written.exists() or not any(written.iterdir())
    return err[0]


def test_bad_inputs_are_one_line_exit_2_nothing_written(tmp_path, capsys):
    source = TH.our_checkpoint(tmp_path, "llama3")
    folder = tmp_path / "titan"
    assert convert_main(["to-titan", "--checkpoint", str(source), "--folder", str(folder)]) == 0
    step_dir = folder / "step-2"
    back = tmp_path / "back"

    def config(**overrides):
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump({"model": {**TH.model_section("llama3", str(tmp_path / "tokenizer.json")),
                                                  **overrides}}))
        return str(path)

    # Another family (a GPT), and a model whose shapes the DCP does not hold.
    line = _refused(capsys, ["from-titan", "--dcp", str(step_dir), "--config", config(architecture="gpt",
                    share_embeddings_and_output_weights=True, num_query_groups=None), "--checkpoint-dir", str(back)],
                    back)
    assert "torchtitan" in line
    line = _refused(capsys, ["from-titan", "--dcp", str(step_dir), "--config", config(hidden_size=64),
                             "--checkpoint-dir", str(back)], back)
    assert "shape" in line
    # A missing DCP, and a corrupt one (a data file cut short).
    assert "no DCP .metadata" in _refused(capsys, ["from-titan", "--dcp", str(tmp_path / "nowhere"), "--config",
                                                   config(), "--checkpoint-dir", str(back)], back)
    broken = tmp_path / "broken" / "step-2"
    shutil.copytree(step_dir, broken)
    data = next(p for p in broken.iterdir() if p.suffix == ".distcp")
    data.write_bytes(data.read_bytes()[:100])
    assert "cannot be read" in _refused(capsys, ["from-titan", "--dcp", str(broken), "--config", config(),
                                                 "--checkpoint-dir", str(back)], back)
    # Ours -> DCP: a missing checkpoint, and one whose config.yaml names a family torchtitan does not build here.
    other = tmp_path / "other"
    _refused(capsys, ["to-titan", "--checkpoint", str(tmp_path / "nowhere"), "--folder", str(other)], other)
    storage, checkpoint = resolve_checkpoint(str(source))
    saved = yaml.safe_load((source / checkpoint.name / "config.yaml").read_text())
    saved["model"]["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    (source / checkpoint.name / "config.yaml").write_text(yaml.safe_dump(saved))
    assert "llama3" in _refused(capsys, ["to-titan", "--checkpoint", str(source), "--folder", str(other)], other)

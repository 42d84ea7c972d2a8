"""One owner per fact (issue 38): the FLOPs formula, the peak table, the precision dtypes, the preemption exit code
and the default dependency are defined once, in runtime/schema (facts.py, choices.py), and both the runtime and the
launcher read those very objects. Then the MFU a run reports and the one an estimate assumes agree on every kind of
device, computed through the runtime's own MetricsLogger."""

import dataclasses
import io
import tokenize
from pathlib import Path

import pytest
import torch

from launcher import neuron, render, runs, stages
from launcher.estimator import compute, estimate, hardware, memory
from launcher.estimator.shapes import ModelShape, vocab_size_for
from launcher.config import parse
from launcher.launch import build
from runtime import device, metrics, peak_probe, precision, preemption
from runtime.peak_probe import Probe
from runtime.schema import choices, facts, sizes
from runtime.schema.model import ModelConfig, MoEConfig
from runtime.schema.training import parse_training
from tests.launcher.helpers import REPO, resolved


def test_peak_table_is_one_object_and_every_estimator_row_reads_it():
    assert metrics.PEAK_TFLOPS is facts.PEAK_TFLOPS
    assert hardware.PEAK_TFLOPS is facts.PEAK_TFLOPS
    assert set(hardware.HARDWARE) == set(facts.PEAK_TFLOPS)  # CPU: no row on either side (measured / assumed)
    for name, row in hardware.HARDWARE.items():
        assert row.peak_tflops == facts.PEAK_TFLOPS[name], name


def test_flops_formula_is_one_function(monkeypatch):
    assert metrics.flops_per_token is sizes.flops_per_token
    calls = []

    def recording(shape):
        calls.append(shape)
        return 42.0

    # The estimator's functions and the runtime's MFU are adapters: what they return is what sizes computes, for
    # the one ModelShape both build.
    monkeypatch.setattr(sizes, "flops_per_token", recording)
    monkeypatch.setattr(sizes, "matmul_weights", recording)
    shape = estimate(resolved("training=mixtral/tiny")["training"], vocab_size=4096).shape
    assert compute.flops_per_token(shape) == 42.0 and compute.matmul_weights(shape) == 42.0
    assert calls and all(call == shape for call in calls)  # the estimate's own calls, then these two


def test_runtime_and_estimator_flops_agree_on_a_head_size_of_its_own():
    """Qwen3's head size is not hidden / heads: the MFU the runtime reports and the estimate's FLOPs both count
    attention heads x head_dim wide."""
    cfg = ModelConfig(architecture="llama", vocab_size=1024, hidden_size=64, num_layers=2, num_attention_heads=4,
                      ffn_hidden_size=128, max_position_embeddings=256, num_query_groups=2, kv_channels=32,
                      qk_layernorm=True)
    shape = ModelShape("llama", 2, 64, 128, 4, 2, 1024, 256, 256, False, kv_channels=32, qk_layernorm=True)
    assert metrics.model_flops_per_token(cfg, 256) == compute.flops_per_token(shape)
    assert metrics.model_flops_per_token(cfg, 256) != metrics.model_flops_per_token(
        dataclasses.replace(cfg, kv_channels=None), 256)


def test_runtime_and_estimator_flops_agree_on_experts_of_their_own_size():
    """Qwen3-MoE's experts are narrower than model.ffn_hidden_size, and only the layers model.moe.layers names are
    sparse: the MFU the runtime reports and the estimate's FLOPs both count a token's top_k experts at their size."""
    moe = MoEConfig(num_experts=4, top_k=2, ffn_hidden_size=24, layers=(1,))
    cfg = ModelConfig(architecture="llama", vocab_size=1024, hidden_size=64, num_layers=3, num_attention_heads=4,
                      ffn_hidden_size=128, max_position_embeddings=256, moe=moe)
    shape = ModelShape("llama", 3, 64, 128, 4, 4, 1024, 256, 256, False, moe=moe)
    assert metrics.model_flops_per_token(cfg, 256) == compute.flops_per_token(shape)
    for other in (dataclasses.replace(moe, ffn_hidden_size=None), dataclasses.replace(moe, layers=(0, 1))):
        assert metrics.model_flops_per_token(dataclasses.replace(cfg, moe=other), 256) != \
            metrics.model_flops_per_token(cfg, 256)


def test_precision_dtypes_are_one_table():
    assert precision.PRECISION_POLICIES is facts.PRECISION_POLICIES
    assert memory.PRECISION_POLICIES is facts.PRECISION_POLICIES
    assert set(facts.PRECISION_POLICIES) == set(choices.PRECISION_TYPES)
    for name, policy in facts.PRECISION_POLICIES.items():
        runtime_policy, bytes_ = precision.get_precision(name), memory.PRECISION_BYTES[name]
        # The torch dtype the runtime holds weights in has the size the estimator counts.
        assert runtime_policy.param_dtype.itemsize == bytes_.param == facts.DTYPE_BYTES[policy.param], name
        compute_dtype = runtime_policy.autocast_dtype or runtime_policy.param_dtype
        assert compute_dtype.itemsize == bytes_.compute, name
        assert bool(bytes_.master) == runtime_policy.master_weights, name
    assert memory.GRAD_BYTES == torch.float32.itemsize and memory.MOMENT_BYTES == 2 * torch.float32.itemsize


def test_preemption_exit_code_is_one_constant():
    assert preemption.PREEMPTED_EXIT_CODE is facts.PREEMPTED_EXIT_CODE
    assert runs.PREEMPTED_EXIT_CODE is facts.PREEMPTED_EXIT_CODE
    assert render.PREEMPTED_EXIT_CODE is facts.PREEMPTED_EXIT_CODE
    # The job script requeues on the code the runtime exits with.
    cfg = resolved("stages=[training]", "cluster=slurm")
    script = render.render(build(cfg)[0], cfg, executor="slurm", produced_by="test")
    assert f'[ "$STEP_EXIT" = {facts.PREEMPTED_EXIT_CODE} ]' in script
    assert _literals("NUMBER", "75") == ["runtime/schema/facts.py"]


def test_default_dependency_is_one_constant():
    assert choices.DEFAULT_DEPENDENCY in choices.DEPENDENCIES
    cfg = resolved("stages=[training]")
    cfg["training"]["run"].pop("dependency", None)
    assert stages.training(parse(cfg)).dependency == choices.DEFAULT_DEPENDENCY
    assert _literals("STRING", '"afterok"') == ["runtime/schema/choices.py"]


def _literals(kind: str, text: str) -> list[str]:
    """Python files under launcher/ and runtime/ holding `text` as a token of `kind` (NUMBER, STRING): what the
    code says, not its comments."""
    found = []
    for path in sorted([*(REPO / "launcher").rglob("*.py"), *(REPO / "runtime").rglob("*.py")]):
        tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
        if any(tokenize.tok_name[t.type] == kind and t.string == text for t in tokens):
            found.append(str(path.relative_to(REPO)))
    return found


# (overrides, --device, the unpadded vocabulary where the recipe's tokenizer is not on this machine, torch's name
# for the GPU): one recipe per kind of device, and an MoE one, whose FLOPs count only the experts a token uses.
CASES = {
    "trn1": (["training=llama3/8b", "cluster=pcluster_trn1"], None, None, None),
    "trn2": (["training=llama3/8b", "cluster=pcluster_trn2"], None, None, None),
    "trn2-moe": (["training=mixtral/8x7b", "cluster=pcluster_trn2"], None, None, None),
    "h100": (["training=gpt3/175b", "cluster=slurm"], None, None, "NVIDIA H100 80GB HBM3"),
    "h200": (["training=gpt3/175b", "cluster=slurm"], "h200", None, "NVIDIA H200"),
    "cpu": (["training=gpt3/tiny"], None, 4096, None),
}


def _runtime_hardware(cfg: dict, gpu_name: str | None, monkeypatch) -> str:
    """What runtime/device.py names the device of this config's training job."""
    accelerator = cfg["training"]["trainer"]["accelerator"]
    if accelerator == "neuron":  # NXDT_NEURON_HARDWARE, as the job script exports it
        return neuron.script(build(cfg)[0], parse(cfg)).env["NXDT_NEURON_HARDWARE"]
    if accelerator == "gpu":
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: gpu_name)
        return device._cuda_hardware(0)
    return "cpu"


@pytest.mark.parametrize("case", CASES)
def test_runtime_mfu_agrees_with_the_estimate(case, tmp_path, monkeypatch):
    overrides, device_name, vocab, gpu_name = CASES[case]
    cfg = resolved(*overrides, "stages=[training]")
    training = cfg["training"]
    vocab = vocab_size_for(training, vocab)
    result = estimate(training, device=device_name, vocab_size=vocab,
                      neuron_hardware=(cfg["cluster"].get("neuron") or {}).get("hardware"))

    # The runtime's side: its config, its device name, its peak lookup. A CPU's peak is measured at start: the
    # probe here reads the estimator's assumed figure, and /proc/cpuinfo says nothing to compete with it.
    runtime_cfg, report = parse_training(training, files="skip", vocab_size=vocab)
    assert runtime_cfg is not None, report.errors
    monkeypatch.setenv("NXDT_PEAK_CACHE", str(tmp_path / "peak.json"))
    monkeypatch.setattr(metrics, "read_cpuinfo", lambda: "")
    monkeypatch.setattr(peak_probe, "measure", lambda: Probe(hardware.CPU_ASSUMED_TFLOPS, 2048))
    peak = metrics.peak_tflops(_runtime_hardware(cfg, gpu_name, monkeypatch))
    assert peak.tflops == result.hardware.peak_tflops, peak.source

    data, trainer = runtime_cfg.data, runtime_cfg.trainer
    flops = metrics.model_flops_per_token(runtime_cfg.model, data.seq_length)
    assert flops == result.flops_per_token
    world_size = trainer.num_nodes * trainer.devices
    assert world_size == result.layout.world_size

    # A step as long as the estimate says it takes at its assumed MFU: the runtime reports that MFU.
    logger = metrics.MetricsLogger(tmp_path / "run", is_main=True, log_every_n_steps=1,
                                   tokens_per_step=data.global_batch_size * data.seq_length, flops_per_token=flops,
                                   num_devices=world_size, peak=peak, tensorboard=False)
    record = logger.record_step(1, loss=1.0, lr=1.0, grad_norm=1.0, step_time_s=result.step_seconds_at_mfu,
                                memory_gib=0.0)
    logger.close()
    assert record["mfu"] is not None, f"{case}: no MFU ({peak.source})"  # trn2 had no row once
    assert record["mfu"] == pytest.approx(result.mfu)
    assert record["tflops_per_device"] == pytest.approx(result.hardware.peak_tflops * result.mfu)

# FLOPs accounting and the metric sinks (metrics.jsonl, TensorBoard, stdout).
import dataclasses
import functools
import json
import time

import pytest
import torch
from torch import nn

from runtime import metrics, peak_probe
from runtime.metrics import MetricsLogger, Peak, cpu_peak, cpu_peak_tflops, flops_per_token, peak_tflops
from runtime.schema.model import MoEConfig
from runtime.schema.sizes import ModelShape
from runtime.models import ModelConfig, build_model
from runtime.peak_probe import Probe


@pytest.mark.parametrize("architecture, groups", [("gpt", None), ("llama", 2)])
def test_flops_formula_counts_every_matmul_weight(architecture, groups):
    cfg = ModelConfig(architecture=architecture, vocab_size=256, hidden_size=64, num_layers=3, num_attention_heads=4,
                      ffn_hidden_size=96, max_position_embeddings=32, num_query_groups=groups,
                      share_embeddings_and_output_weights=architecture == "gpt")
    model = build_model(cfg)
    # Every Linear's weight, the output head included even when it shares the embedding's storage.
    matmul_weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    seq = 32
    flops = flops_per_token(ModelShape.of_model(cfg, seq))
    assert flops == 6 * matmul_weights + 12 * cfg.num_layers * cfg.hidden_size * seq


def test_peak_table_and_cpu_theoretical_peak(monkeypatch):
    monkeypatch.setattr(metrics, "cached_probe", None)  # an accelerator's peak is looked up: no probe runs
    assert peak_tflops("h100") == Peak(989.0, "table:h100")
    assert peak_tflops("trn2") == Peak(667.0 / 4, "table:trn2")  # a logical NeuronCore at LNC=2
    info = "processor\t: 0\ncpu MHz\t\t: 2596.150\nflags\t\t: fpu sse2 avx2 fma avx512f\n" \
           "processor\t: 1\ncpu MHz\t\t: 3000.000\nflags\t\t: fpu sse2 avx2 fma avx512f\n"
    assert cpu_peak_tflops(info, threads=2) == (pytest.approx(2 * 3.0 * 64 / 1000),
                                                "cpu: 2 cores x 3.00 GHz x 64 fp32 FLOP/cycle")
    assert cpu_peak_tflops(info.replace(" avx512f", ""), threads=1)[0] == pytest.approx(3.0 * 32 / 1000)
    assert cpu_peak_tflops("processor\t: 0\n", threads=1) is None  # says too little: MFU is not reported


def test_cpu_peak_is_the_higher_of_theory_and_probe(tmp_path, monkeypatch):
    info = "model name\t: Example CPU\ncpu MHz\t\t: 2000.000\nflags\t\t: fpu sse2 avx2 fma\n"  # 0.128 on 2
    monkeypatch.setattr(peak_probe, "measure", lambda: Probe(0.2, 2048))  # turbo: above the theory
    peak = cpu_peak(info, 2, tmp_path / "a.json")
    assert peak.tflops == 0.2 and peak.source.startswith("probe: best fp32 matmul on 2 threads, above the theor")
    monkeypatch.setattr(peak_probe, "measure", lambda: Probe(0.05, 2048))
    assert cpu_peak(info, 2, tmp_path / "b.json") == Peak(pytest.approx(0.128), "cpu: 2 cores x 2.00 GHz x 32 fp32 "
                                                                                 "FLOP/cycle", Probe(0.05, 2048))
    assert cpu_peak("", 2, tmp_path / "b.json").tflops == 0.05  # cpuinfo says nothing: the probe is the peak


def _realistic_step_tflops() -> float:
    """What a real training step (a small GPT's forward, backward and update) achieves on this machine's cores."""
    cfg = ModelConfig(architecture="gpt", vocab_size=512, hidden_size=256, num_layers=2, num_attention_heads=4,
                      ffn_hidden_size=1024, max_position_embeddings=128)
    model = build_model(cfg)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, cfg.vocab_size, (4, 129))
    for _ in range(2):  # the first step pays for allocation
        started = time.perf_counter()
        model(tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        elapsed = time.perf_counter() - started
    per_token = flops_per_token(ModelShape.of_model(cfg, 128))
    return per_token * 4 * 128 / elapsed / 1e12


def _slow_probe(monkeypatch):
    """The probe as heavy load leaves it: every multiply takes 1000x as long."""
    real = peak_probe._timed_matmul
    monkeypatch.setattr(peak_probe, "measure", functools.partial(
        peak_probe.measure, timed_matmul=lambda a, b, out: 1000 * real(a, b, out)))


def _record_at(tmp_path, peak: Peak, tflops: float) -> dict:
    """The record MetricsLogger writes for a step at `tflops`; mfu_raw would be in it had the cap been needed."""
    logger = MetricsLogger(tmp_path / "run", is_main=True, log_every_n_steps=1, tokens_per_step=1,
                           flops_per_token=tflops * 1e12, num_devices=1, peak=peak, tensorboard=False)
    record = logger.record_step(1, loss=1, lr=1, grad_norm=1, step_time_s=1.0, memory_gib=0)
    logger.close()
    return record


def test_a_probe_slowed_by_load_leaves_mfu_honest_without_the_cap(tmp_path, monkeypatch, capsys):
    """The probe's first measurement, taken under heavy load, reads 1000x slow: the peak is still the theoretical
    one, and a real step's MFU is <= 100% as computed, not as capped."""
    _slow_probe(monkeypatch)
    cpuinfo, threads = peak_probe.read_cpuinfo(), torch.get_num_threads()
    theory = cpu_peak_tflops(cpuinfo, threads)
    if theory is None:
        pytest.skip("/proc/cpuinfo has no clock or FMA width here: see the test with a quiet figure cached")
    peak = cpu_peak(cpuinfo, threads, tmp_path / "peak.json")
    assert peak.probe.tflops < theory[0] / 100  # the probe read slow (and metrics.jsonl says so)
    assert (peak.tflops, peak.source) == (theory[0], theory[1])
    record = _record_at(tmp_path, peak, _realistic_step_tflops())
    assert 0 < record["mfu"] <= 1 and "mfu_raw" not in record, record
    assert record["probe_tflops"] == peak.probe.tflops and "warning" not in capsys.readouterr().err


def test_a_probe_slowed_by_load_cannot_lower_a_cached_quiet_figure(tmp_path, monkeypatch, capsys):
    """Where cpuinfo says too little, the probe is the peak: the best figure a quiet run cached stays it."""
    path, cpuinfo, threads = tmp_path / "peak.json", "", torch.get_num_threads()
    key = peak_probe.machine_key(cpuinfo, threads)
    quiet = peak_probe.record(peak_probe.measure(sizes=(512, 1024)), key, path)
    _slow_probe(monkeypatch)
    assert peak_probe.record(peak_probe.measure(), key, path) == quiet  # e.g. `python -m runtime.peak_probe`
    peak = cpu_peak(cpuinfo, threads, path)
    assert peak.tflops == quiet.tflops
    record = _record_at(tmp_path, peak, _realistic_step_tflops())
    assert 0 < record["mfu"] <= 1 and "mfu_raw" not in record, record
    assert "warning" not in capsys.readouterr().err


def test_mfu_above_100_percent_is_capped_with_one_warning_naming_the_peak(tmp_path, capsys):
    logger = MetricsLogger(tmp_path, is_main=True, log_every_n_steps=1, tokens_per_step=1000, flops_per_token=1e6,
                           num_devices=1, peak=Peak(1e-3, "probe: too low"), tensorboard=False)
    records = [logger.record_step(step, loss=1, lr=1, grad_norm=1, step_time_s=0.5, memory_gib=0)
               for step in (1, 2)]
    logger.close()
    assert all(r["mfu"] == 1.0 and r["mfu_raw"] == pytest.approx(2.0) for r in records)  # 2e-3 TFLOP/s achieved
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("warning: step 1: MFU 200% against a peak of 0.001 TFLOP/s "
                                               "(probe: too low)"), err
    written = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert written[0]["mfu_raw"] == pytest.approx(2.0) and written[0]["peak_source"] == "probe: too low"


def test_progress_shows_step_of_max_steps_and_time_left(tmp_path, capsys):
    logger = MetricsLogger(tmp_path, is_main=True, log_every_n_steps=5, tokens_per_step=10, flops_per_token=1.0,
                           num_devices=1, tensorboard=False, max_steps=100)
    logger.record_step(1, loss=1, lr=1, grad_norm=1, step_time_s=30.0, memory_gib=0)  # warm-up: not the pace
    for step in range(2, 11):
        logger.record_step(step, loss=1, lr=1, grad_norm=1, step_time_s=2.0, memory_gib=0)
    logger.close()
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("step 1/100 (eta 0:49:30) | ")  # only the first step's pace is known yet
    assert out[-1].startswith("step 10/100 (eta 0:03:00) | ")  # 90 steps left at 2 s


def test_logger_writes_jsonl_tensorboard_and_stdout(tmp_path, capsys):
    logger = MetricsLogger(tmp_path, is_main=True, log_every_n_steps=2, tokens_per_step=1000,
                           flops_per_token=1e6, num_devices=2, peak=Peak(0.01, "cpu: test", Probe(0.008, 2048)))
    for step in range(1, 5):
        logger.record_step(step, loss=5.0 - step, lr=1e-3, grad_norm=0.5, step_time_s=0.5, memory_gib=1.0)
    logger.record_validation(4, 1.25)
    logger.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 4, 4]
    last = records[2]
    assert last["tokens_per_s"] == pytest.approx(2000.0)  # 1000 tokens per 0.5 s step (window of steps 3, 4)
    assert last["tflops_per_device"] == pytest.approx(1e6 * 2000 / 2 / 1e12)
    assert last["mfu"] == pytest.approx(last["tflops_per_device"] / 0.01)
    assert {k: last[k] for k in ("peak_tflops", "peak_source", "probe_tflops", "probe_size")} == {
        "peak_tflops": 0.01, "peak_source": "cpu: test", "probe_tflops": 0.008, "probe_size": 2048}
    assert records[3] == {"step": 4, "val_loss": 1.25}
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("step 1 | loss 4.0000 | lr 1.000e-03") and out[-1] == "step 4 | val_loss 1.2500"


def test_other_ranks_write_nothing(tmp_path, capsys):
    logger = MetricsLogger(tmp_path / "r", is_main=False, log_every_n_steps=1, tokens_per_step=1,
                           flops_per_token=1.0, num_devices=1)
    assert logger.record_step(1, loss=1, lr=1, grad_norm=1, step_time_s=1, memory_gib=0)["mfu"] is None
    logger.close()
    assert not (tmp_path / "r").exists() and capsys.readouterr().out == ""


def test_wandb_missing_is_a_clear_error(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(ValueError, match="exp_manager.create_wandb_logger is true but wandb is not installed"):
        MetricsLogger(tmp_path, is_main=True, log_every_n_steps=1, tokens_per_step=1, flops_per_token=1.0,
                      num_devices=1, tensorboard=False, wandb=True)


def test_nemo_wandb_logger_kwargs_map_onto_wandb_init(tmp_path):
    from runtime.metrics import wandb_init_args

    args = wandb_init_args(tmp_path, "gpt3_tiny", {"a": 1}, {"project": "p", "name": None, "tags": ["x", 2],
                                                            "save_dir": "/w", "version": "run7"}, environ={})
    assert args == {"project": "p", "name": "gpt3_tiny", "dir": "/w", "config": {"a": 1}, "tags": ["x", "2"],
                    "id": "run7", "mode": "offline"}  # no WANDB_API_KEY: offline, synced later with `wandb sync`
    assert wandb_init_args(tmp_path, "r", {}, {}, environ={"WANDB_API_KEY": "k"})["mode"] == "online"
    assert wandb_init_args(tmp_path, "r", {}, {"offline": True}, environ={"WANDB_API_KEY": "k"})["mode"] == "offline"


def test_unknown_wandb_logger_kwargs_are_named():
    from runtime.schema.training import _wandb_kwargs
    from runtime.schema.reader import Report, Section

    report = Report()
    kept = _wandb_kwargs(Section({"wandb_logger_kwargs": {"project": "p", "log_model": True}}, "training.exp_manager",
                                 report), "training.", report)
    assert kept == {"project": "p"}
    assert report.errors == ["training.exp_manager.wandb_logger_kwargs.log_model: not a W&B setting nxdt-launch "
                             "passes on; valid: project, name, group, tags, entity, notes, job_type, offline, "
                             "save_dir, id, version, resume"]


def test_wandb_logs_offline_with_nemo_kwargs(tmp_path, monkeypatch):
    """The real wandb, with no network and no credentials: an offline run under the results dir that `wandb sync`
    uploads later, named and tagged by NeMo's wandb_logger_kwargs."""
    pytest.importorskip("wandb")
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR", "WANDB_PROJECT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = MetricsLogger(tmp_path, is_main=True, log_every_n_steps=1, tokens_per_step=10, flops_per_token=1.0,
                           num_devices=1, tensorboard=False, wandb=True, run_name="gpt3_tiny",
                           wandb_kwargs={"project": "nemo-project", "name": "first-try", "tags": ["tiny"]},
                           config={"trainer": {"max_steps": 2}})
    for step in (1, 2):
        logger.record_step(step, loss=3.0 - step, lr=1e-3, grad_norm=1.0, step_time_s=0.1, memory_gib=0.0)
    logger.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((tmp_path / "wandb").iterdir())
    # The run's log (protobuf records) is written by wandb's own service process, which can still be flushing it
    # when finish() returns on a busy machine (seen once: only the file header was there yet).
    deadline = time.monotonic() + 30
    while True:
        record = b"".join(p.read_bytes() for p in runs[0].glob("run-*.wandb"))
        if b"first-try" in record or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert b"nemo-project" in record and b"first-try" in record and b"tiny" in record


def test_moe_flops_count_what_a_token_uses():
    """An MoE layer costs a token its top_k experts' MLPs and the router, not every expert."""
    dense = ModelShape("llama", 2, 64, 128, 4, 4, 256, 32, 32, False)
    moe = dataclasses.replace(dense, moe=MoEConfig(num_experts=8, top_k=2))
    mlp = 3 * 64 * 128
    # one more MLP and a router per layer
    assert flops_per_token(moe) - flops_per_token(dense) == pytest.approx(6.0 * 2 * (mlp + 64 * 8))
    one_of_two = dataclasses.replace(dense, moe=MoEConfig(num_experts=8, top_k=2, layers=(0,)))
    assert flops_per_token(one_of_two) - flops_per_token(dense) == pytest.approx(6.0 * (mlp + 64 * 8))

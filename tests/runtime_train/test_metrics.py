# FLOPs accounting and the metric sinks (metrics.jsonl, TensorBoard, stdout).
import json
import time

import pytest
import torch
from torch import nn

from runtime.metrics import MetricsLogger, cpu_peak_tflops, flops_per_token, peak_tflops
from runtime.models import ModelConfig, build_model


@pytest.mark.parametrize("architecture, groups", [("gpt", None), ("llama", 2)])
def test_flops_formula_counts_every_matmul_weight(architecture, groups):
    cfg = ModelConfig(architecture=architecture, vocab_size=256, hidden_size=64, num_layers=3, num_attention_heads=4,
                      ffn_hidden_size=96, max_position_embeddings=32, num_query_groups=groups,
                      share_embeddings_and_output_weights=architecture == "gpt")
    model = build_model(cfg)
    # Every Linear's weight, the output head included even when it shares the embedding's storage.
    matmul_weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    seq = 32
    flops = flops_per_token(cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_attention_heads,
                            cfg.kv_heads, cfg.vocab_size, seq, gated_mlp=architecture == "llama")
    assert flops == 6 * matmul_weights + 12 * cfg.num_layers * cfg.hidden_size * seq


def test_peak_table_and_cpu_theoretical_peak():
    assert peak_tflops("H100") == (989.0, "table:H100")
    info = "processor\t: 0\ncpu MHz\t\t: 2596.150\nflags\t\t: fpu sse2 avx2 fma avx512f\n" \
           "processor\t: 1\ncpu MHz\t\t: 3000.000\nflags\t\t: fpu sse2 avx2 fma avx512f\n"
    assert cpu_peak_tflops(info, threads=2) == (pytest.approx(2 * 3.0 * 64 / 1000),
                                                "cpu: 2 cores x 3.00 GHz x 64 fp32 FLOP/cycle")
    assert cpu_peak_tflops(info.replace(" avx512f", ""), threads=1)[0] == pytest.approx(3.0 * 32 / 1000)
    assert cpu_peak_tflops("processor\t: 0\n", threads=1) is None  # says too little: MFU is not reported


def test_cpu_peak_is_above_what_a_matmul_achieves_here():
    """The point of a theoretical peak: MFU <= 100%. A large fp32 matmul on this machine's cores stays below."""
    peak, _ = peak_tflops("cpu")
    a, b = torch.randn(1536, 1536), torch.randn(1536, 1536)
    a @ b
    started = time.perf_counter()
    for _ in range(4):
        a @ b
    achieved = 4 * 2 * 1536**3 / (time.perf_counter() - started) / 1e12
    assert 0 < achieved < peak, (achieved, peak)


def test_progress_shows_step_of_max_steps_and_time_left(tmp_path, capsys):
    logger = MetricsLogger(tmp_path, is_main=True, log_every_n_steps=5, tokens_per_step=10, flops_per_token=1.0,
                           num_devices=1, peak_tflops=None, tensorboard=False, max_steps=100)
    logger.record_step(1, loss=1, lr=1, grad_norm=1, step_time_s=30.0, memory_gib=0)  # warm-up: not the pace
    for step in range(2, 11):
        logger.record_step(step, loss=1, lr=1, grad_norm=1, step_time_s=2.0, memory_gib=0)
    logger.close()
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("step 1/100 (eta 0:49:30) | ")  # only the first step's pace is known yet
    assert out[-1].startswith("step 10/100 (eta 0:03:00) | ")  # 90 steps left at 2 s


def test_logger_writes_jsonl_tensorboard_and_stdout(tmp_path, capsys):
    logger = MetricsLogger(tmp_path, is_main=True, log_every_n_steps=2, tokens_per_step=1000,
                           flops_per_token=1e6, num_devices=2, peak_tflops=0.01)
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
    assert records[3] == {"step": 4, "val_loss": 1.25}
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("step 1 | loss 4.0000 | lr 1.000e-03") and out[-1] == "step 4 | val_loss 1.2500"


def test_other_ranks_write_nothing(tmp_path, capsys):
    logger = MetricsLogger(tmp_path / "r", is_main=False, log_every_n_steps=1, tokens_per_step=1,
                           flops_per_token=1.0, num_devices=1, peak_tflops=None)
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
                      num_devices=1, peak_tflops=None, tensorboard=False, wandb=True)


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
                           num_devices=1, peak_tflops=None, tensorboard=False, wandb=True, run_name="gpt3_tiny",
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
    dense = flops_per_token(2, 64, 128, 4, 4, 256, 32, gated_mlp=True)
    moe = flops_per_token(2, 64, 128, 4, 4, 256, 32, gated_mlp=True, moe_layers=2, moe_top_k=2, moe_num_experts=8)
    mlp = 3 * 64 * 128
    assert moe - dense == pytest.approx(6.0 * 2 * (mlp + 64 * 8))  # one more MLP and a router per layer
    one_of_two = flops_per_token(2, 64, 128, 4, 4, 256, 32, gated_mlp=True, moe_layers=1, moe_top_k=2,
                                 moe_num_experts=8)
    assert one_of_two - dense == pytest.approx(6.0 * (mlp + 64 * 8))

"""What the XLA tests share (tests/runtime_xla): the configs they train, the launch of a training process, and the
checks on what it wrote. The fixtures that run the processes are in conftest.py, shared by the test modules."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.runtime_train.helpers import REPO, reference_training_config


def skip_without_torch_xla() -> None:
    """Whether torch-xla is installed, without importing it here: only the training processes use it, and its import
    (torch's compiler stack with it) costs this process over 15 s of CPU."""
    if importlib.util.find_spec("torch_xla") is None:
        if os.environ.get("NXDT_REQUIRE_XLA") == "1":
            raise ImportError("NXDT_REQUIRE_XLA=1 but torch-xla is not installed in this environment")
        pytest.skip("torch-xla is not installed here (run in the environment csp_tools/xla_venv.sh builds)",
                    allow_module_level=True)


# Three validations and saves: the first is warm-up, the second shows the same graphs (and the step after it the same
# step graphs) again; the last is the run's end, a synchronous save. More steps would check nothing more.
STEPS = 6
EVERY = 2  # validation and checkpoint saves
# A clipping threshold inside each model's range of gradient norms over these steps (per architecture and global batch
# size), so that some steps clip and some do not: clipping is arithmetic in the step's one graph, not a branch
# compiling another.
CLIP = {("gpt", 4): 1.5, ("llama", 4): 1.2, ("gpt_oss", 4): 1.45, ("gpt", 8): 1.2, ("llama", 8): 1.0}


# Llama runs here with every switch the Llama 3.1+ and Qwen families turn on (tests/runtime_parallel/harness.py
# FAMILY_SWITCHES): a head size of its own, q/k/v biases, per-head q/k norms, Llama 3.1's RoPE scaling.
FAMILY = dict(kv_channels=12, add_qkv_bias=True, qk_layernorm=True,
              rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 4})

# GPT-OSS (runtime/families/gpt_oss; tests/runtime_parallel/harness.py GPT_OSS): attention sinks spelled out, layer
# 0 sliding (a window of 4), YaRN, and MoE experts with biases and the clamped SwiGLU at a capacity factor, whose
# fixed expert batches keep a step one graph (dropless batches would follow the routing).
GPT_OSS = dict(architecture="gpt_oss", kv_channels=12, sliding_window=4,
               layer_types=["sliding_attention", "full_attention"],
               rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4},
               moe={"num_experts": 4, "top_k": 2, "capacity_factor": 2.0, "router_aux_loss_coef": 0.02})


def _config(data, name, *, accelerator, devices=1, gbs=4, arch="gpt", **model):
    raw = reference_training_config(arch, results_dir=data / name, data_prefix=[1.0, str(data / "corpus")],
                                    tokenizer=data / "tokenizer.json")
    raw["trainer"].update(accelerator=accelerator, devices=devices, max_steps=STEPS, log_every_n_steps=1,
                          val_check_interval=EVERY, limit_val_batches=1,
                          gradient_clip_val=CLIP[model.get("architecture", arch), gbs])
    raw["model"].update(dict(encoder_seq_length=16, max_position_embeddings=16, num_layers=2, hidden_size=32,
                             ffn_hidden_size=128, num_attention_heads=4, micro_batch_size=2, global_batch_size=gbs,
                             make_vocab_size_divisible_by=16), **model)  # a model key given overrides its size
    raw["model"]["data"].update(seq_length=16, splits_string="90,5,5", index_mapping_dir=str(data / f"index_{name}"))
    # eps 1e-4: the key bias has a mathematically zero gradient, and a small eps lets Adam amplify each backend's
    # own float noise in it (~1e-7) into sizeable, different updates; these tests compare compute, not noise.
    raw["model"]["optim"]["eps"] = 1e-4
    raw["model"]["optim"]["sched"].update(warmup_steps=1, min_lr=1e-4)
    raw["exp_manager"]["create_tensorboard_logger"] = False
    raw["exp_manager"]["checkpoint_callback_params"]["every_n_train_steps"] = EVERY
    path = data / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


# XLA:CPU stands in for the Neuron compiler here: what the tests compare is the graph the runtime traces, not how
# fast the machine code XLA:CPU makes of it runs (a step executes in under a second; compiling its graphs was
# ~80 s of CPU per process). LLVM at -O0, and fusions emitted by the older elemental emitter instead of the MLIR
# fusion emitters, compile the same HLO (the same ops, fp32, no fast-math either way) about 6x faster; the losses
# still agree with the CPU run's to ~1e-7 relative (1 ulp; the asserts allow 1e-4). And each module is compiled
# whole rather than split into parts for parallel code generation, which on 2 busy cores only adds the splitting:
# the XLA tests measured 221 s of CPU against 253 s with the default split.
XLA_FLAGS = ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
             "--xla_cpu_parallel_codegen_split_count=1")


def _launch(program: list[str], nproc: int = 1, extra_env: dict | None = None, *, ok: bool = True):
    env = dict(os.environ, PJRT_DEVICE="CPU", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **(extra_env or {}))
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {XLA_FLAGS}".strip()
    # Every process imports torch (and torch-xla with torch's compiler stack: ~2,700 modules). Where bytecode is
    # not written (PYTHONDONTWRITEBYTECODE; the XLA venv then has none either) each would compile them all again,
    # 5-10 s of CPU apiece: the package's processes share one bytecode cache in its temporary directory instead.
    if env.pop("PYTHONDONTWRITEBYTECODE", None):
        env.setdefault("PYTHONPYCACHEPREFIX", str(Path(program[-1]).parent / "pycache"))
    prefix = [] if nproc == 1 else ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    result = subprocess.run([sys.executable, *prefix, *program], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=600)
    if ok:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert "after warm-up" not in result.stderr, result.stderr[-3000:]  # runtime/graphs.py's recompile line
    return result


def _rows(config) -> list[dict]:
    results = yaml.safe_load(config.read_text())["run"]["results_dir"]
    return [json.loads(line) for line in open(os.path.join(results, "metrics.jsonl")) if '"loss"' in line]


def _losses(config) -> list[float]:
    return [r["loss"] for r in _rows(config)]


def _assert_fixed_graphs(config, graphs_per_step: int | None = 1, logged: int = 0) -> None:
    """After warm-up nothing compiles, and every steady step runs the same graphs and device-to-host transfers:
    one and one in one process (graphs_per_step=1), a fixed number where host-staged collectives cut the step;
    a logged read, `logged` of each (MoE layers: 1, their statistics, runtime/models/moe.py step_stats).

    Row n of metrics.jsonl counts what ran since row n-1: step n and its logged read, and the validation and save
    of step n-1. Warm-up: row 1 (the first step and its logged read), row EVERY + 1 (the first validation and
    save)."""
    rows = _rows(config)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    norms = [r["grad_norm"] for r in rows[1:]]
    clip = yaml.safe_load(config.read_text())["trainer"]["gradient_clip_val"]
    assert min(norms) < clip < max(norms), norms  # steps that clip and steps that do not
    steady = rows[1]["xla_window"]
    for row in rows:
        window = row["xla_window"]
        assert window["steps"] == 1
        if row["step"] not in (1, EVERY + 1):
            assert row["xla_compiles"] == 0, row
        if row["step"] == 1:
            continue
        assert window["step"][0] == 0, row  # the step never compiles again (step 2, after a save, clipped or not)
        assert window["step"][1:] == steady["step"][1:], row
        assert window["logging"] == steady["logging"], row
        if row["step"] % EVERY == 1 and row["step"] > EVERY + 1:
            first = rows[EVERY]["xla_window"]
            assert window["validation"][1:] == first["validation"][1:] and window["save"][1:] == first["save"][1:]
    if graphs_per_step is not None:
        assert steady["step"][1:] == [graphs_per_step, 1], steady
        assert steady["logging"] == [0, logged, logged], steady
        first = rows[EVERY]["xla_window"]  # one graph and one transfer for a validation; a save's are its writer's
        assert first["validation"][1:] == [1, 1] and first["save"] == [0, 0, 0], first


# Mixtral's experts over ep=2, with a capacity factor as on Trainium: every expert batch and all-to-all has a fixed
# shape, so one graph serves every step (dropless shapes follow the routing, and XLA would compile each new one).
MOE = dict(arch="llama", num_query_groups=2,
           moe={"num_experts": 4, "top_k": 2, "dropless": False, "capacity_factor": 1.0, "router_aux_loss_coef": 0.02})
# The two-process layouts, each on two XLA:CPU devices with gradients and activations crossing through gloo on host
# copies: dp=2; Llama at tp=2 with sequence parallelism (moving a model to an XLA device makes new Parameters, so anything
# the parallel layout kept on the old ones would be lost there: the sharding plan is kept by name); Mixtral's
# experts over ep=2; each sequence split over cp=2 (ring attention's spelled-out block math, what Trainium compiles,
# its K/V passes point to point, learned positions at the chunks' positions).
# One layer where a second would only repeat the first's graph: XLA's compile time grows faster than the graph, and
# the four layouts' compiles were most of the XLA tests' CPU (two layers: 142 s for the launch, one: 81 s). tp keeps
# two, its sharding plan being kept by parameter name (a name mixed up between layers shows only with two). The
# single-process runs, and every layout on the CPU (tests/runtime_parallel), have two or more.
ONE_LAYER = dict(num_layers=1)
LAYOUTS = {"dp": ONE_LAYER, "tp": dict(arch="llama", tensor_model_parallel_size=2, sequence_parallel=True, **FAMILY),
           "ep": dict(expert_model_parallel_size=2, **MOE, **ONE_LAYER),
           "cp": dict(context_parallel_size=2, **ONE_LAYER)}


def _assert_matches(cpu: list[float], xla: list[float], what: str) -> None:
    assert len(cpu) == len(xla) == STEPS
    for step, (a, b) in enumerate(zip(cpu, xla), start=1):
        assert abs(a - b) <= 1e-4 * abs(a), f"step {step}: one cpu process {a}, {what} on xla {b}"

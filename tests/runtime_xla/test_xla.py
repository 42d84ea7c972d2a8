"""The runtime on torch-xla's CPU device (PJRT_DEVICE=CPU): the same code path Trainium takes, minus the
Neuron compiler. These tests run in the separate XLA environment (csp_tools/xla_venv.sh; .ci/run does it);
in the main environment, where torch-xla is absent, they are skipped, unless NXDT_REQUIRE_XLA=1.

What XLA:CPU cannot do: collectives between processes through the xla backend (each process's XLA:CPU
client is alone; PJRT's CPU client has no cross-process transport). The multi-process test therefore
computes on the XLA device and runs its collectives through gloo on host copies."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.runtime_train.helpers import REPO, build_tokenizer, reference_training_config, write_mmidx

pytestmark = pytest.mark.xla

# Whether torch-xla is installed, without importing it here: only the training processes use it, and its import
# (torch's compiler stack with it) costs this process over 15 s of CPU.
if importlib.util.find_spec("torch_xla") is None:
    if os.environ.get("NXDT_REQUIRE_XLA") == "1":
        raise ImportError("NXDT_REQUIRE_XLA=1 but torch-xla is not installed in this environment")
    pytest.skip("torch-xla is not installed here (run in the environment csp_tools/xla_venv.sh builds)",
                allow_module_level=True)

STEPS = 6


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    import numpy as np

    root = tmp_path_factory.mktemp("xla")
    build_tokenizer(root / "tokenizer.json", [f"w{i}" for i in range(48)])
    rng = np.random.default_rng(0)
    docs = [(rng.integers(48) + rng.choice((1, 3)) * np.arange(rng.integers(30, 90))) % 48 + 1 for _ in range(120)]
    write_mmidx(root / "corpus", docs)
    return root


def _config(data, name, *, accelerator, devices=1, gbs=4, arch="gpt", **model):
    raw = reference_training_config(arch, results_dir=data / name, data_prefix=[1.0, str(data / "corpus")],
                                    tokenizer=data / "tokenizer.json")
    raw["trainer"].update(accelerator=accelerator, devices=devices, max_steps=STEPS, log_every_n_steps=1,
                          val_check_interval=1000, limit_val_batches=1)
    raw["model"].update(encoder_seq_length=16, max_position_embeddings=16, num_layers=2, hidden_size=32,
                        ffn_hidden_size=128, num_attention_heads=4, micro_batch_size=2, global_batch_size=gbs,
                        make_vocab_size_divisible_by=16, **model)
    raw["model"]["data"].update(seq_length=16, splits_string="90,5,5", index_mapping_dir=str(data / f"index_{name}"))
    # eps 1e-4: the key bias has a mathematically zero gradient, and a small eps lets Adam amplify each backend's
    # own float noise in it (~1e-7) into sizeable, different updates; these tests compare compute, not noise.
    raw["model"]["optim"]["eps"] = 1e-4
    raw["model"]["optim"]["sched"].update(warmup_steps=1, min_lr=1e-4)
    raw["exp_manager"]["create_tensorboard_logger"] = False
    path = data / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


# XLA:CPU stands in for the Neuron compiler here: what the tests compare is the graph the runtime traces, not how
# fast the machine code XLA:CPU makes of it runs (a step executes in under a second; compiling its graphs was
# ~80 s of CPU per process). LLVM at -O0, and fusions emitted by the older elemental emitter instead of the MLIR
# fusion emitters, compile the same HLO (the same ops, fp32, no fast-math either way) about 6x faster; the losses
# still agree with the CPU run's to ~1e-7 relative (1 ulp; the asserts allow 1e-4).
XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


def _launch(program: list[str], nproc: int = 1, extra_env: dict | None = None) -> None:
    env = dict(os.environ, PJRT_DEVICE="CPU", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **(extra_env or {}))
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {XLA_FLAGS}".strip()
    # Every process imports torch (and torch-xla with torch's compiler stack: ~2,700 modules). Where bytecode is
    # not written (PYTHONDONTWRITEBYTECODE; the XLA venv then has none either) each would compile them all again,
    # 5-10 s of CPU apiece: the module's processes share one bytecode cache in its temporary directory instead.
    if env.pop("PYTHONDONTWRITEBYTECODE", None):
        env.setdefault("PYTHONPYCACHEPREFIX", str(Path(program[-1]).parent / "pycache"))
    prefix = [] if nproc == 1 else ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    result = subprocess.run([sys.executable, *prefix, *program], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def _losses(config) -> list[float]:
    results = yaml.safe_load(config.read_text())["run"]["results_dir"]
    rows = [json.loads(line) for line in open(os.path.join(results, "metrics.jsonl"))]
    return [r["loss"] for r in rows if "loss" in r]


def _train(config, nproc=1, extra_env=None):
    _launch(["-m", "runtime.train", "--config", str(config)], nproc, extra_env)
    return _losses(config)


@pytest.mark.long("two processes: the CPU reference, and an XLA:CPU run that imports torch-xla and compiles two "
                  "step graphs (the first step's, then the later steps') before they run")
def test_single_process_on_xla_matches_cpu(data):
    cpu = _train(_config(data, "cpu", accelerator="cpu"))
    xla = _train(_config(data, "xla", accelerator="neuron"))
    assert len(cpu) == len(xla) == STEPS
    # Same weights, data and math in fp32; XLA fuses and orders some reductions differently.
    for step, (a, b) in enumerate(zip(cpu, xla), start=1):
        assert abs(a - b) <= 1e-4 * abs(a), f"step {step}: cpu {a} xla {b}"


@pytest.fixture(scope="module")
def one_cpu_process(data):
    """The reference of every two-process GPT test below: one CPU process, global batch 8."""
    return _train(_config(data, "gbs8_cpu", accelerator="cpu", gbs=8))


# Mixtral's experts over ep=2, with a capacity factor as on Trainium: every expert batch and all-to-all has a fixed
# shape, so one graph serves every step (dropless shapes follow the routing, and XLA would compile each new one).
MOE = dict(arch="llama", num_query_groups=2,
           moe={"num_experts": 4, "top_k": 2, "dropless": False, "capacity_factor": 1.0, "router_aux_loss_coef": 0.02})
# The two-process layouts, each on two XLA:CPU devices with gradients and activations crossing through gloo on host
# copies: dp=2; tp=2 with sequence parallelism (moving a model to an XLA device makes new Parameters, so anything
# the parallel layout kept on the old ones would be lost there: the sharding plan is kept by name); Mixtral's
# experts over ep=2; each sequence split over cp=2 (ring attention's spelled-out block math, what Trainium compiles,
# its K/V passes point to point, learned positions at the chunks' positions).
LAYOUTS = {"dp": {}, "tp": dict(tensor_model_parallel_size=2, sequence_parallel=True),
           "ep": dict(expert_model_parallel_size=2, **MOE), "cp": dict(context_parallel_size=2)}
LONG = pytest.mark.long("the module's one torchrun launch of the four two-process layouts on 2 cores (each rank "
                        "imports torch-xla once and compiles every layout's step graphs), or its wait on it")


@pytest.fixture(scope="module")
def two_processes(data):
    """Every layout's losses from one torchrun launch of two XLA:CPU ranks (tests/runtime_xla/suite.py): a launch
    per layout paid torchrun's start and two torch-xla imports again (~20 s of CPU) for each."""
    configs = {name: _config(data, f"{name}_xla", accelerator="neuron", devices=2, gbs=8, **model)
               for name, model in LAYOUTS.items()}
    _launch(["-m", "tests.runtime_xla.suite", *map(str, configs.values())], 2, {"NXDT_XLA_COLLECTIVES": "gloo"})
    return {name: _losses(path) for name, path in configs.items()}


def _assert_matches(cpu: list[float], xla: list[float], what: str) -> None:
    assert len(cpu) == len(xla) == STEPS
    for step, (a, b) in enumerate(zip(cpu, xla), start=1):
        assert abs(a - b) <= 1e-4 * abs(a), f"step {step}: one cpu process {a}, {what} on xla {b}"


@LONG
def test_two_process_data_parallel_on_xla_matches_one_cpu_process(two_processes, one_cpu_process):
    _assert_matches(one_cpu_process, two_processes["dp"], "dp=2")


@LONG
def test_two_process_tensor_and_sequence_parallel_on_xla_matches_one_cpu_process(two_processes, one_cpu_process):
    _assert_matches(one_cpu_process, two_processes["tp"], "tp=2 + sp")


@LONG
def test_two_process_expert_parallel_on_xla_matches_one_cpu_process(data, two_processes):
    """Against its own CPU reference: the same MoE model in one CPU process."""
    _assert_matches(_train(_config(data, "ep_cpu", accelerator="cpu", gbs=8, **MOE)), two_processes["ep"], "ep=2")


@LONG
def test_two_process_context_parallel_on_xla_matches_one_cpu_process(two_processes, one_cpu_process):
    _assert_matches(one_cpu_process, two_processes["cp"], "cp=2")

"""The runtime on torch-xla's CPU device (PJRT_DEVICE=CPU): the same code path Trainium takes, minus the
Neuron compiler. These tests run in the separate XLA environment (csp_tools/xla_venv.sh; .ci/run does it);
in the main environment, where torch-xla is absent, they are skipped, unless NXDT_REQUIRE_XLA=1.

Each run trains 30 steps with a validation and a checkpoint save every 10, every step logged, gradient clipping
active on some steps and not on others, and checks two things against one CPU process: the losses (exactness), and
what the device ran (runtime/graphs.py's counts in metrics.jsonl): after the warm-up (the first step, validation,
save and logged read) no graph is compiled again, and each steady step runs the same graphs and transfers.

What XLA:CPU cannot do: collectives between processes through the xla backend. torch-xla 2.9's PJRT CPU client
has only in-process collectives (xla::cpu::InProcessCollectives; no gloo or MPI transport is built in), so under
torchrun each process joins a world of its own: test_xla_backend_world_of_one_is_refused shows the runtime
refusing that. The multi-process tests therefore compute on the XLA device and run their collectives through gloo
on host copies, each of which ends a graph: a step of theirs runs a fixed number of graphs, more than one."""

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

STEPS = 30
EVERY = 10  # validation and checkpoint saves
# A clipping threshold inside each model's range of gradient norms over these steps (per global batch size), so that
# some steps clip and some do not: clipping is arithmetic in the step's one graph, not a branch compiling another.
CLIP = {("gpt", 4): 1.5, ("llama", 4): 1.15, ("gpt", 8): 1.5, ("llama", 8): 1.0}


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
                          val_check_interval=EVERY, limit_val_batches=1, gradient_clip_val=CLIP[arch, gbs])
    raw["model"].update(encoder_seq_length=16, max_position_embeddings=16, num_layers=2, hidden_size=32,
                        ffn_hidden_size=128, num_attention_heads=4, micro_batch_size=2, global_batch_size=gbs,
                        make_vocab_size_divisible_by=16, **model)
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
# still agree with the CPU run's to ~1e-7 relative (1 ulp; the asserts allow 1e-4).
XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


def _launch(program: list[str], nproc: int = 1, extra_env: dict | None = None, *, ok: bool = True):
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


def _train(config, nproc=1, extra_env=None):
    _launch(["-m", "runtime.train", "--config", str(config)], nproc, extra_env)
    return _losses(config)


@pytest.fixture(scope="module")
def compiled_first(data, tmp_path_factory):
    """The GPT XLA run, after the launcher's compile step (launcher/config.py cut_to_steps: what the job script runs
    under neuron_parallel_compile before training) filled XLA's persistent cache; the cache's entries after each."""
    from launcher.config import cut_to_steps

    config = _config(data, "xla_gpt", accelerator="neuron")
    trial = data / "xla_gpt_compile.yaml"
    trial.write_text(yaml.safe_dump(cut_to_steps(yaml.safe_load(config.read_text()), 3, str(data / "compile"))))
    cache = tmp_path_factory.mktemp("xla_cache")
    env = {"NXDT_XLA_CACHE_DIR": str(cache)}
    _launch(["-m", "runtime.train", "--config", str(trial)], 1, env)
    after_compile = set(os.listdir(cache))
    _launch(["-m", "runtime.train", "--config", str(config)], 1, env)
    return config, after_compile, set(os.listdir(cache))


@pytest.mark.long("two processes: the CPU reference, and an XLA:CPU run that imports torch-xla and compiles its "
                  "step, validation and save graphs before they run (for GPT, after the compile step's run)")
@pytest.mark.parametrize("arch", ["gpt", "llama", "gpt_oss"])
def test_single_process_on_xla_matches_cpu_and_compiles_nothing_after_warm_up(data, arch, request):
    switches = {"llama": FAMILY, "gpt_oss": GPT_OSS}.get(arch, {})
    base = "llama" if arch == "gpt_oss" else arch  # GPT-OSS on the Llama reference's data, schedule and sizes
    cpu = _train(_config(data, f"cpu_{arch}", accelerator="cpu", arch=base, **switches))
    if arch == "gpt":
        config = request.getfixturevalue("compiled_first")[0]
    else:
        config = _config(data, f"xla_{arch}", accelerator="neuron", arch=base, **switches)
        _train(config)
    xla = _losses(config)
    assert len(cpu) == len(xla) == STEPS
    # Same weights, data and math in fp32; XLA fuses and orders some reductions differently.
    for step, (a, b) in enumerate(zip(cpu, xla), start=1):
        assert abs(a - b) <= 1e-4 * abs(a), f"step {step}: cpu {a} xla {b}"
    _assert_fixed_graphs(config, logged=1 if arch == "gpt_oss" else 0)


@pytest.mark.long("shares the GPT run of the test above, and its compile step's run")
def test_the_compile_step_runs_every_graph_the_training_runs(compiled_first):
    """XLA's persistent cache stores each compiled graph under its hash: the real run adds none, so every graph it
    compiled (step, validation, save, after a save, logged or not, clipped or not) the compile step had compiled.

    On XLA:CPU the run still compiles each again: torch-xla 2.9's CPU client cannot load a stored executable
    (its counters say PersistentCacheDeserializeFailure; TPU and GPU clients can), so "zero uncached compiles" is
    shown here as zero cache misses, the same graphs, by the cache's own keys."""
    _, after_compile, after_run = compiled_first
    assert after_compile and after_run == after_compile, (after_compile, after_run)


@pytest.mark.long("a torchrun launch of two processes, each importing torch-xla before it refuses")
def test_xla_backend_world_of_one_is_refused(data):
    """torchrun starts two processes; torch-xla's xla backend on XLA:CPU joins each to a world of its own (its PJRT
    CPU client reaches no other process), where every collective would return the local value: every rank refuses
    with one line instead of training two independent copies."""
    config = _config(data, "xla_world", accelerator="neuron", devices=2, gbs=8)
    result = _launch(["-m", "runtime.train", "--config", str(config)], 2, ok=False)
    assert result.returncode != 0
    for prefix in ("error: ", "error (rank 1): "):
        assert f"{prefix}the launch started 2 processes (WORLD_SIZE) but the xla backend joined a world of 1" \
            in result.stderr, result.stderr[-3000:]
    assert f'File "{REPO / "runtime"}' not in result.stderr, result.stderr[-3000:]  # torchrun's own summary aside
    assert not (data / "xla_world").exists() or not any((data / "xla_world").iterdir())


@pytest.fixture(scope="module")
def one_cpu_process(data):
    """The reference of the two-process GPT tests below: one CPU process, global batch 8."""
    return _train(_config(data, "gbs8_cpu", accelerator="cpu", gbs=8))


# Mixtral's experts over ep=2, with a capacity factor as on Trainium: every expert batch and all-to-all has a fixed
# shape, so one graph serves every step (dropless shapes follow the routing, and XLA would compile each new one).
MOE = dict(arch="llama", num_query_groups=2,
           moe={"num_experts": 4, "top_k": 2, "dropless": False, "capacity_factor": 1.0, "router_aux_loss_coef": 0.02})
# The two-process layouts, each on two XLA:CPU devices with gradients and activations crossing through gloo on host
# copies: dp=2; Llama at tp=2 with sequence parallelism (moving a model to an XLA device makes new Parameters, so anything
# the parallel layout kept on the old ones would be lost there: the sharding plan is kept by name); Mixtral's
# experts over ep=2; each sequence split over cp=2 (ring attention's spelled-out block math, what Trainium compiles,
# its K/V passes point to point, learned positions at the chunks' positions).
LAYOUTS = {"dp": {}, "tp": dict(arch="llama", tensor_model_parallel_size=2, sequence_parallel=True, **FAMILY),
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
    return configs


def _two_process_result(configs, name: str, clipping: bool = True) -> list[float]:
    """A layout's losses, once its graphs are checked: fixed after warm-up (each gloo collective ends a graph, so a
    step runs several, always the same ones)."""
    if clipping:
        _assert_fixed_graphs(configs[name], graphs_per_step=None)
    else:  # the clipping threshold is set for the dense models' gradient norms
        rows = _rows(configs[name])
        assert all(r["xla_compiles"] == 0 for r in rows if r["step"] not in (1, EVERY + 1)), rows
    return _losses(configs[name])


def _assert_matches(cpu: list[float], xla: list[float], what: str) -> None:
    assert len(cpu) == len(xla) == STEPS
    for step, (a, b) in enumerate(zip(cpu, xla), start=1):
        assert abs(a - b) <= 1e-4 * abs(a), f"step {step}: one cpu process {a}, {what} on xla {b}"


@LONG
def test_two_process_data_parallel_on_xla_matches_one_cpu_process(two_processes, one_cpu_process):
    _assert_matches(one_cpu_process, _two_process_result(two_processes, "dp"), "dp=2")


@LONG
def test_two_process_tensor_and_sequence_parallel_on_xla_matches_one_cpu_process(data, two_processes):
    """Llama, against its own CPU reference (global batch 8)."""
    cpu = _train(_config(data, "gbs8_llama_cpu", accelerator="cpu", gbs=8, arch="llama", **FAMILY))
    _assert_matches(cpu, _two_process_result(two_processes, "tp"), "tp=2 + sp")


@LONG
def test_two_process_expert_parallel_on_xla_matches_one_cpu_process(data, two_processes):
    """Against its own CPU reference: the same MoE model in one CPU process."""
    _assert_matches(_train(_config(data, "ep_cpu", accelerator="cpu", gbs=8, **MOE)),
                    _two_process_result(two_processes, "ep", clipping=False), "ep=2")


@LONG
def test_two_process_context_parallel_on_xla_matches_one_cpu_process(two_processes, one_cpu_process):
    _assert_matches(one_cpu_process, _two_process_result(two_processes, "cp"), "cp=2")

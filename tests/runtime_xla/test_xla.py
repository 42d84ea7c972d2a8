"""The runtime on torch-xla's CPU device (PJRT_DEVICE=CPU): the same code path Trainium takes, minus the
Neuron compiler. These tests run in the separate XLA environment (csp_tools/xla_venv.sh; .ci/run does it);
in the main environment, where torch-xla is absent, they are skipped, unless NXDT_REQUIRE_XLA=1.

Each run trains 6 steps with a validation and a checkpoint save every 2, every step logged, gradient clipping
active on some steps and not on others, and checks two things against one CPU process: the losses (exactness), and
what the device ran (runtime/graphs.py's counts in metrics.jsonl): after the warm-up (the first step, validation,
save and logged read) no graph is compiled again, and each steady step runs the same graphs and transfers.

What XLA:CPU cannot do: collectives between processes through the xla backend. torch-xla 2.9's PJRT CPU client
has only in-process collectives (xla::cpu::InProcessCollectives; no gloo or MPI transport is built in), so under
torchrun each process joins a world of its own: test_xla_backend_world_of_one_is_refused shows the runtime
refusing that. The multi-process tests therefore compute on the XLA device and run their collectives through gloo
on host copies, each of which ends a graph: a step of theirs runs a fixed number of graphs, more than one."""

import pytest

from tests.runtime_xla.harness import (EVERY, LAYOUTS, STEPS, _assert_fixed_graphs, _assert_matches, _config, _launch,
                                       _losses, _rows, skip_without_torch_xla)
from tests.servers import free_port

pytestmark = pytest.mark.xla
skip_without_torch_xla()


@pytest.mark.long("the package's one CPU process of references, and its two XLA:CPU processes (the compile step's with "
                  "the Llama and GPT-OSS runs, then the GPT run), each importing torch-xla and compiling its graphs")
@pytest.mark.parametrize("arch", ["gpt", "llama", "gpt_oss"])
def test_single_process_on_xla_matches_cpu_and_compiles_nothing_after_warm_up(cpu_references, single_process, arch):
    cpu, config = cpu_references[arch], single_process[0][arch]
    xla = _losses(config)
    assert len(cpu) == len(xla) == STEPS
    # Same weights, data and math in fp32; XLA fuses and orders some reductions differently.
    for step, (a, b) in enumerate(zip(cpu, xla), start=1):
        assert abs(a - b) <= 1e-4 * abs(a), f"step {step}: cpu {a} xla {b}"
    _assert_fixed_graphs(config, logged=1 if arch == "gpt_oss" else 0)


@pytest.mark.long("shares the XLA runs of the test above")
def test_the_compile_step_runs_every_graph_the_training_runs(single_process):
    """XLA's persistent cache stores each compiled graph under its hash: the real run adds none, so every graph it
    compiled (step, validation, save, after a save, logged or not, clipped or not) the compile step had compiled.

    On XLA:CPU the run still compiles each again: torch-xla 2.9's CPU client cannot load a stored executable
    (its counters say PersistentCacheDeserializeFailure; TPU and GPU clients can), so "zero uncached compiles" is
    shown here as zero cache misses, the same graphs, by the cache's own keys. (The compile step's process also ran
    the Llama and GPT-OSS runs: their entries are other graphs, and one the GPT run shares with them is one its cache
    would serve, as Neuron's would.)"""
    _, after_compile, after_run, _ = single_process
    assert after_compile and after_run == after_compile, (after_compile, after_run)


@pytest.mark.long("a training process importing torch-xla before it refuses")
def test_xla_backend_world_of_one_is_refused(data):
    """torchrun starts two processes; torch-xla's xla backend on XLA:CPU joins each to a world of its own (its PJRT
    CPU client reaches no other process), where every collective would return the local value: every rank refuses
    with one line instead of training two independent copies. Each rank decides alone, from torchrun's environment
    and the world its backend joined: one process in rank 0's environment of a world of 2 shows it (a torchrun
    launch added its agent's and a second rank's torch-xla imports, ~15 s of CPU, to see the same line twice)."""
    config = _config(data, "xla_world", accelerator="neuron", devices=2, gbs=8)
    torchrun_env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    result = _launch(["-m", "runtime.train", "--config", str(config)], 1, torchrun_env, ok=False)
    assert result.returncode != 0
    assert "error: the launch started 2 processes (WORLD_SIZE) but the xla backend joined a world of 1" \
        in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert not (data / "xla_world").exists() or not any((data / "xla_world").iterdir())


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


@LONG
def test_two_process_data_parallel_on_xla_matches_one_cpu_process(two_processes, cpu_references):
    _assert_matches(cpu_references["gbs8"], _two_process_result(two_processes, "dp"), "dp=2")


@LONG
def test_two_process_tensor_and_sequence_parallel_on_xla_matches_one_cpu_process(two_processes, cpu_references):
    """Llama, against its own CPU reference (global batch 8)."""
    _assert_matches(cpu_references["gbs8_llama"], _two_process_result(two_processes, "tp"), "tp=2 + sp")


@LONG
def test_two_process_expert_parallel_on_xla_matches_one_cpu_process(two_processes, cpu_references):
    """Against its own CPU reference: the same MoE model in one CPU process."""
    _assert_matches(cpu_references["gbs8_ep"], _two_process_result(two_processes, "ep", clipping=False), "ep=2")


@LONG
def test_two_process_context_parallel_on_xla_matches_one_cpu_process(two_processes, cpu_references):
    _assert_matches(cpu_references["gbs8"], _two_process_result(two_processes, "cp"), "cp=2")

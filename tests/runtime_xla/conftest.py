"""The XLA tests' processes, each started once for the package and shared by the tests that check it (every process
pays torch's import, ~4 s of CPU, and an XLA one torch-xla's too, ~11 s, and its graphs' compiles):

- one CPU process trains every CPU reference in turn (tests/runtime_xla/suite.py: the runtime's own train(), each
  config with its own model, data and results; one process, world 1, as `python -m runtime.train` runs each);
- one XLA process runs the launcher's compile step of the GPT run, then the Llama and GPT-OSS runs, filling XLA's
  persistent cache; a second runs the GPT run itself with a save held in flight each time (gated_save.py; the
  runtime's own streamed save), against that cache, then its reference with the whole host copy at each save;
- one torchrun launch trains the four two-process layouts (test_xla.py two_processes)."""

import json
import os

import pytest
import yaml

from tests.runtime_train.helpers import build_tokenizer, write_mmidx
from tests.runtime_xla.harness import FAMILY, GPT_OSS, MOE, ONE_LAYER, _config, _launch, _losses


@pytest.fixture(scope="package")
def data(tmp_path_factory):
    import numpy as np

    root = tmp_path_factory.mktemp("xla")
    build_tokenizer(root / "tokenizer.json", [f"w{i}" for i in range(48)])
    rng = np.random.default_rng(0)
    docs = [(rng.integers(48) + rng.choice((1, 3)) * np.arange(rng.integers(30, 90))) % 48 + 1 for _ in range(120)]
    write_mmidx(root / "corpus", docs)
    return root


# The CPU references: each model at the XLA runs' global batch (GPT-OSS on the Llama reference's data, schedule and
# sizes), one process, global batch 4 for the single-process tests and 8 for the two-process layouts (of one layer
# as theirs, but for Llama's: harness.py LAYOUTS).
CPU_REFERENCES = {
    "gpt": dict(arch="gpt"), "llama": dict(arch="llama", **FAMILY), "gpt_oss": dict(arch="llama", **GPT_OSS),
    "gbs8": dict(gbs=8, **ONE_LAYER), "gbs8_llama": dict(gbs=8, arch="llama", **FAMILY),
    "gbs8_ep": dict(gbs=8, **MOE, **ONE_LAYER),
}


@pytest.fixture(scope="package")
def cpu_references(data) -> dict[str, list[float]]:
    """Every CPU reference's losses, from one CPU process (suite.py trains each config in turn)."""
    configs = {name: _config(data, f"cpu_{name}", accelerator="cpu", **model)
               for name, model in CPU_REFERENCES.items()}
    _launch(["-m", "tests.runtime_xla.suite", *map(str, configs.values())])
    return {name: _losses(config) for name, config in configs.items()}


@pytest.fixture(scope="package")
def single_process(data, tmp_path_factory):
    """The single-process XLA runs, two processes sharing XLA's persistent cache.

    The first runs the launcher's compile step of the GPT run (launcher/config.py cut_to_steps: what the job script
    runs under neuron_parallel_compile before training), then the Llama and GPT-OSS runs. The second runs the GPT run
    (gated_save.py streamed: the runtime's own save, each held in flight over the next update), then, once the cache's
    entries are listed, the same run again with the whole host copy at each save (gated_save.py whole: the streamed
    save's reference, test_streamed_save_xla.py). Returns the configs, the cache's entries after the first process
    and after the GPT run, and the two GPT runs' records."""
    from launcher.config import cut_to_steps

    configs = {"gpt": _config(data, "xla_gpt", accelerator="neuron"),
               "llama": _config(data, "xla_llama", accelerator="neuron", arch="llama", **FAMILY),
               "gpt_oss": _config(data, "xla_gpt_oss", accelerator="neuron", arch="llama", **GPT_OSS),
               "whole": _config(data, "xla_gpt_whole", accelerator="neuron")}
    trial = data / "xla_gpt_compile.yaml"
    trial.write_text(yaml.safe_dump(cut_to_steps(yaml.safe_load(configs["gpt"].read_text()), 3,
                                                 str(data / "compile"))))
    cache = tmp_path_factory.mktemp("xla_cache")
    env = {"NXDT_XLA_CACHE_DIR": str(cache)}
    _launch(["-m", "tests.runtime_xla.suite", str(trial), str(configs["llama"]), str(configs["gpt_oss"])], 1, env)
    after_compile = set(os.listdir(cache))
    records = {"streamed": data / "xla_gpt.json", "whole": data / "xla_gpt_whole.json"}
    _launch(["-m", "tests.runtime_xla.gated_save", "streamed", str(records["streamed"]), str(configs["gpt"]),
             "whole", str(records["whole"]), str(configs["whole"])], 1, env)
    records = {mode: json.loads(path.read_text()) for mode, path in records.items()}
    return configs, after_compile, set(records["streamed"]["cache"]), records

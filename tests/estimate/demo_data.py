"""The demo corpus (tokenizer + token files) made by the launcher's own data stage, for tests that train."""

from pathlib import Path

import numpy as np

from tests.launcher.helpers import nxdt

DEMO_VOCAB = 4096  # data_preparation=demo's tokenizer


def prepare_demo_data(root: Path) -> Path:
    """Run `nxdt-launch stages=[data_preparation]` locally under `root`; returns the data_dir holding demo/."""
    result = nxdt("stages=[data_preparation]", "cluster_type=local", f"data_dir={root / 'data'}",
                  f"base_results_dir={root / 'results'}", cwd=root, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert (root / "data" / "demo" / "blend.txt").exists()
    return root / "data"


def demo_shaped_data(root: Path) -> Path:
    """A data_dir holding demo/ as the tiny recipes read it (tokenizer.json, blend.txt and its token files) with the
    demo tokenizer's 4096 tokens, written directly: for tests whose subject is not the data preparation (the memory
    of a step depends on the vocabulary's size and the batch's shape, not on which tokens the documents hold)."""
    from tests.runtime_train.helpers import build_tokenizer, write_mmidx

    demo = root / "demo"
    demo.mkdir(parents=True)
    vocab = build_tokenizer(demo / "tokenizer.json", [f"w{i}" for i in range(DEMO_VOCAB - 1)])  # and <unk>
    assert vocab == DEMO_VOCAB, vocab
    rng = np.random.default_rng(0)
    write_mmidx(demo / "corpus", [rng.integers(1, vocab, rng.integers(100, 300)) for _ in range(400)])
    (demo / "blend.txt").write_text(f"1.0 {demo / 'corpus'}\n")
    return root

"""`python -m runtime.data_prep` end to end on conf/data_preparation/demo.yaml, as the launcher runs it."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from omegaconf import OmegaConf

from runtime.data_prep.plan import check_inputs, count_tasks
from tests.data_prep.conftest import REPO, read_indexed, run_cli


def _resolved_demo(tmp_path) -> dict:
    """The stage subtree resolved the way the launcher does (Seam 1)."""
    root = OmegaConf.create({"base_results_dir": str(tmp_path / "results"), "run_name": "gpt3_tiny",
                             "data_dir": str(tmp_path / "data"),
                             "data_preparation": OmegaConf.load(REPO / "conf/data_preparation/demo.yaml")})
    return OmegaConf.to_container(root, resolve=True)["data_preparation"]


def _demo_outputs(data_dir):
    demo = data_dir / "demo"
    files = {p.name: p.read_bytes() for p in sorted(demo.glob("*_text_document.*"))}
    files["tokenizer.json"] = (demo / "tokenizer.json").read_bytes()
    files["blend.txt"] = (demo / "blend.txt").read_text().replace(str(demo), "DEMO").encode()
    return files


def test_demo_two_tasks_end_to_end(tmp_path):
    from tokenizers import Tokenizer

    cfg = _resolved_demo(tmp_path)
    assert cfg["run"]["results_dir"] == str(tmp_path / "results/gpt3_tiny/data_preparation")
    assert check_inputs(cfg) == [] and count_tasks(cfg) == 2
    started = time.monotonic()
    results = [run_cli(cfg, tmp_path, "--task-index", str(i), "--num-tasks", "2") for i in range(2)]
    seconds = time.monotonic() - started
    for result in results:
        assert result.returncode == 0, result.stdout + result.stderr
    assert seconds < 60, f"the demo took {seconds:.0f}s"
    demo = tmp_path / "data" / "demo"
    tokenizer = Tokenizer.from_file(str(demo / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == 4096 and tokenizer.token_to_id("<|endoftext|>") == 0
    blend = [line.split() for line in (demo / "blend.txt").read_text().splitlines()]
    assert [prefix for _, prefix in blend] == [str(demo / "demo_00_text_document"),
                                               str(demo / "demo_01_text_document")]
    summary = json.loads((demo / "summary.json").read_text())
    assert summary["tokens"] == sum(int(weight) for weight, _ in blend) > 500_000
    assert summary["shards"] == 2 and summary["skipped_lines"] == 0
    assert json.loads((tmp_path / "results/gpt3_tiny/data_preparation/summary.json").read_text())["tokens"] == \
        summary["tokens"]
    # Lossless: every document decodes back to the demo corpus text, EOD after each.
    raw = [json.loads(line)["text"] for line in (demo / "raw" / "demo_01.jsonl").read_text().splitlines()]
    dtype, docs = read_indexed(demo / "demo_01_text_document")
    assert str(dtype) == "uint16" and len(docs) == len(raw)
    for doc, text in list(zip(docs, raw))[::50]:
        assert doc[-1] == 0 and tokenizer.decode(doc[:-1].tolist(), skip_special_tokens=False) == text
    assert "1 of 2 shards: demo_01" in results[1].stdout and "all 2 shards complete" in results[1].stdout
    assert "tok/s" in results[0].stdout and "MB/s" in results[0].stdout

    # The same two tasks at once (as on Slurm) give the same bytes.
    parallel = tmp_path / "parallel"
    cfg2 = _resolved_demo(parallel)
    procs = [run_cli(cfg2, tmp_path, "--task-index", str(i), "--num-tasks", "2", wait=False,
                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert _demo_outputs(parallel / "data") == _demo_outputs(tmp_path / "data")


def test_cli_user_errors_exit_2_without_traceback(tmp_path):
    cfg = _resolved_demo(tmp_path)
    cfg["tokenizer"]["train"]["vocab_size"] = "4k"
    result = run_cli(cfg, tmp_path)
    assert result.returncode == 2
    assert result.stderr == "error: data_preparation.tokenizer.train.vocab_size: '4k' is not an integer\n"
    cfg = _resolved_demo(tmp_path)
    result = run_cli(cfg, tmp_path, "--task-index", "2", "--num-tasks", "2")
    assert result.returncode == 2 and "--task-index 2 with --num-tasks 2" in result.stderr
    missing = subprocess.run([sys.executable, "-m", "runtime.data_prep", "--config", str(tmp_path / "nope.yaml")],
                             cwd=REPO, capture_output=True, text=True)
    assert missing.returncode == 2 and missing.stderr.strip().endswith("nope.yaml': no such file")


def test_rich_progress_on_a_terminal(tmp_path, hf_tokenizer, capsys):
    from runtime.schema.data_preparation import parse_config
    from runtime.data_prep.progress import Reporter
    from runtime.data_prep.run import run_task
    from tests.data_prep.conftest import make_texts, stage, write_jsonl

    write_jsonl(tmp_path / "in" / "a.jsonl", make_texts(100, seed=40))
    cfg = parse_config(stage(tmp_path, tokenizer={"model": str(hf_tokenizer)}))
    assert run_task(cfg, 0, 1, Reporter("tty", tty=True))
    out = capsys.readouterr().out
    assert "docs/s" in out and "tok/s" in out and "all 1 shards complete" in out


@pytest.mark.parametrize("name", ["demo.yaml", "custom_dataset.yaml", "gpt3/download_pile.yaml"])
def test_shipped_configs_parse(tmp_path, name):
    from runtime.schema.data_preparation import parse_config

    root = OmegaConf.create({"base_results_dir": "/r", "run_name": "x", "data_dir": "/d",
                             "data_preparation": OmegaConf.load(REPO / "conf/data_preparation" / name)})
    cfg = OmegaConf.to_container(root, resolve=True)["data_preparation"]
    parsed = parse_config(cfg)
    assert parsed.run.node_array_size >= 1 and parsed.workers_per_node >= 1
    if name.endswith("download_pile.yaml"):
        assert count_tasks(cfg) == 30      # nothing fetched: URLs are only counted
        assert check_inputs(cfg) == []

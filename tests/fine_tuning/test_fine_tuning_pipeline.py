"""The fine-tuning stages end to end through the real CLI: full SFT from a Hugging Face Qwen3 directory written by
transformers (fine_tuning=hf/sft_demo: its config.json and tokenizer decide), exported; LoRA from that run's own
checkpoint (rendered by the CLI, run in this process), exported merged and as a PEFT adapter that `peft` loads; and
stages=[data_preparation,fine_tuning] on two nodes of the real 3-node Slurm cluster."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from runtime.convert import load_hf_directory
from runtime.generate import generate
from runtime.models import ModelConfig, build_model
from runtime.schema.chat import ChatTokenizer
from runtime.schema.rules import padded_vocab_size
from runtime.sft.synthetic import write_demo
from tests.checkpoint.launch_helpers import stages_here
from tests.launcher.helpers import nxdt

transformers = pytest.importorskip("transformers")
# A small Qwen3 shape; conf/fine_tuning/hf/sft_demo.yaml takes every key from its config.json.
SHAPE = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, rope_theta=1e6, rms_norm_eps=1e-6)
SHORT = ["trainer.max_steps=6", "trainer.val_check_interval=3", "trainer.limit_val_batches=1",
         "trainer.devices=1", "trainer.preflight=false", "model.global_batch_size=4", "model.micro_batch_size=2",
         "model.encoder_seq_length=128", "model.optim.sched.warmup_steps=1",
         "exp_manager.create_tensorboard_logger=false", "exp_manager.create_metrics_plot=false"]


def _demo(data: Path) -> int:
    """The synthetic instruction set, small; returns the padded vocabulary the tiny recipe builds from it."""
    write_demo(data / "sft_demo", num_train=300, num_valid=20, num_test=20, seed=3, vocab_size=512)
    tokenizer = json.loads((data / "sft_demo" / "tokenizer.json").read_text())
    size = len(tokenizer["model"]["vocab"]) + sum(t["id"] >= len(tokenizer["model"]["vocab"])
                                                   for t in tokenizer.get("added_tokens", []))
    return padded_vocab_size(size, 128)


def _hf_qwen3(directory: Path, vocab: int, data: Path):
    """A tiny Qwen3 written by transformers, with the demo's tokenizer and chat template beside it (as a downloaded
    model directory holds its own): its head size (48) is not hidden / heads (32), its head tied."""
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=vocab, max_position_embeddings=256, head_dim=48,
                                      tie_word_embeddings=True, **SHAPE)
    model = transformers.Qwen3ForCausalLM(config).eval()
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(data / "sft_demo" / name, directory / name)
    return model


def _stage(stage: str, *overrides: str) -> list[str]:
    return [f"{stage}.{o}" for o in SHORT + list(overrides)]


def _logits(directory: Path, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return transformers.AutoModelForCausalLM.from_pretrained(directory).eval()(ids).logits


@pytest.mark.long("SFT from a Hugging Face Qwen3, then LoRA from that checkpoint, each exported and checked in transformers")
def test_fine_tunes_a_hugging_face_qwen3_then_lora_from_our_checkpoint(tmp_path):
    vocab = _demo(tmp_path / "data")
    base = _hf_qwen3(tmp_path / "hf_base", vocab, tmp_path / "data")
    ids = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(0))
    common = ["cluster_type=local", f"data_dir={tmp_path}/data", f"base_results_dir={tmp_path}/results"]

    # 1. Full SFT from the Hugging Face directory, which decides the model and the tokenizer; exported in the same
    # command with that tokenizer.
    sft = nxdt(*common, "stages=[fine_tuning,conversion]", "fine_tuning=hf/sft_demo",
               *_stage("fine_tuning", f"model.restore_from_path={tmp_path}/hf_base"), cwd=tmp_path, timeout=900)
    assert sft.returncode == 0, sft.stdout[-3000:] + sft.stderr[-3000:]
    run = tmp_path / "results" / "hf_sft_demo"
    log = (run / "fine_tuning" / "logs").glob("*.log")
    text = "".join(p.read_text() for p in log)
    assert f"fine-tuning from {tmp_path}/hf_base" in text and "step 6 | val_loss" in text, text[-2000:]
    exported = run / "conversion" / "hf_model"
    assert json.loads((exported / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    assert (exported / "tokenizer.json").read_bytes() == (tmp_path / "hf_base" / "tokenizer.json").read_bytes()
    with torch.no_grad():
        before = base(ids).logits
    after = _logits(exported, ids)
    assert after.shape == before.shape and not torch.allclose(after, before, atol=1e-4), "it trained"
    _answers_as_the_runtime_does(exported, tmp_path / "data" / "sft_demo" / "test.jsonl")

    # 2. LoRA from that run's own checkpoint (weights only; the export's config.json and tokenizer say what model
    # it holds), exported merged and as a PEFT adapter. Rendered by the launcher (--dry-run), its rank forked from this
    # process and its conversion run in it (stages_here): the launch of the two stages is step 1's.
    peft_lib = pytest.importorskip("peft")
    lora_run = tmp_path / "results" / "hf_sft_demo_lora"
    stages_here([*common, "stages=[peft,conversion]", "peft=hf/sft_demo", "conversion.lora=both",
                 *_stage("peft", f"model.restore_from_path={run}/fine_tuning/checkpoints",
                         f"model.model_config={exported}/config.json",
                         f"model.tokenizer.model={exported}/tokenizer.json")], tmp_path, lora_run, "peft")
    checkpoint = sorted((lora_run / "peft" / "checkpoints").glob("step_*"))[-1]
    saved = sum(p.stat().st_size for p in checkpoint.rglob("*.pt"))
    assert saved < 2_000_000, f"a LoRA checkpoint holds the adapters alone ({saved} bytes)"
    merged_dir = lora_run / "conversion" / "hf_model"
    merged = _logits(merged_dir, ids)
    torch.testing.assert_close(_logits(merged_dir / "base", ids), after, rtol=0, atol=1e-5)  # the SFT weights
    with torch.no_grad():
        adapted = peft_lib.PeftModel.from_pretrained(
            transformers.AutoModelForCausalLM.from_pretrained(merged_dir / "base"), merged_dir / "adapter").eval()(ids)
    torch.testing.assert_close(adapted.logits, merged, rtol=0, atol=1e-5)
    assert not torch.allclose(merged, after, atol=1e-5), "the adapters trained"


def _answers_as_the_runtime_does(exported: Path, test_file: Path) -> None:
    """The export, prompted through transformers' chat template and generate(), answers as the runtime does (the
    same model read back, our chat template code, runtime.generate): the same prompt tokens, and the same greedy
    answer, which generate() ends at the chat's end of turn (generation_config.json) as the runtime does."""
    chat = ChatTokenizer(exported / "tokenizer.json")
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    hf = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    state, keys, _ = load_hf_directory(exported)
    ours = build_model(ModelConfig.from_model_section(keys, hf.config.vocab_size)).eval()
    ours.load_state_dict(state)
    stops = hf.generation_config.eos_token_id
    assert set(stops if isinstance(stops, list) else [stops]) == chat.stop_ids
    answered = 0
    for line in test_file.read_text().splitlines()[:3]:
        messages = json.loads(line)["messages"]
        prompt = chat.prompt_ids(messages)
        text = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=False)
        assert tokenizer(text, add_special_tokens=False)["input_ids"] == prompt, text
        with torch.no_grad():
            (answer,) = generate(ours, [prompt], max_new_tokens=24, stop_ids=chat.stop_ids,
                                 vocab_size=len(tokenizer))
            theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):].tolist()
        ended = theirs[len(answer):]  # nothing (24 tokens) or the one stop token generate() ended with
        assert theirs[:len(answer)] == answer and (ended == [] or (len(ended) == 1 and ended[0] in chat.stop_ids)), \
            (theirs, answer)
        answered += len(answer)
    assert answered, "some answer has tokens"


@pytest.mark.slurm
def test_fine_tuning_on_two_slurm_nodes(slurm_cluster, tmp_path):
    results = tmp_path / "results"
    result = nxdt("cluster_type=slurm", f"cluster.partition={slurm_cluster.partition}", f"base_results_dir={results}",
                  f"data_dir={tmp_path}/data", "stages=[data_preparation,fine_tuning]", "data_preparation=sft_demo",
                  "data_preparation.synthetic_instructions.num_train=400", "fine_tuning=llama/tiny",
                  "fine_tuning.trainer.num_nodes=2", *_stage("fine_tuning"), cwd=tmp_path, env=slurm_cluster.env)
    assert result.returncode == 0, result.stdout + result.stderr
    record = json.loads((results / "llama_tiny_sft" / "launch.json").read_text())
    states = [slurm_cluster.wait_job(str(s["job_id"]), 600) for s in record["stages"]]
    logs = nxdt("logs", "llama_tiny_sft", "--results-dir", str(results), env=slurm_cluster.env).stdout
    assert states == ["COMPLETED"] * 2, logs[-4000:]
    assert len(sorted((results / "llama_tiny_sft" / "fine_tuning" / "logs").glob("*_node*.log"))) == 2
    assert "dp=0/2" in logs and "step 6 | val_loss" in logs, logs[-3000:]
    rows = [json.loads(line) for line in (results / "llama_tiny_sft" / "fine_tuning" / "metrics.jsonl").read_text()
            .splitlines() if line.strip()]
    assert rows[0]["step"] == 1 and rows[-1]["step"] == 6 and "val_loss" in rows[-1], rows[-2:]

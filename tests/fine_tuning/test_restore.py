"""model.restore_from_path (runtime/finetune.py): fine-tuning starts from a Hugging Face directory written by
transformers itself, or from a checkpoint of ours; weights of another model are one line naming the key."""
from __future__ import annotations

import pytest
import torch

from runtime.checkpoint import write_full_checkpoint
from runtime.finetune import load_pretrained, prepare_for_fine_tuning
from runtime.models import build_model
from runtime.schema.model import ModelConfig
from runtime.schema.training_config import LoraConfig

transformers = pytest.importorskip("transformers")
SHAPE = dict(hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
             max_position_embeddings=32, rotary_base=10000.0)


def ours(**overrides) -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=128, **{**SHAPE, **overrides})


def hf_llama(directory, hidden: int = 32):
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=hidden, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # a visible norm and larger weights, so any misplaced tensor shows in the logits
        for p in model.parameters():
            p.mul_(5.0) if p.dim() > 1 else p.add_(torch.randn(p.shape) * 0.1)
    model.save_pretrained(directory)
    return model


def test_starts_from_a_hugging_face_directory(tmp_path):
    theirs = hf_llama(tmp_path / "hf")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    model = build_model(ours())
    load_pretrained(model, str(tmp_path / "hf"))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), theirs(ids).logits, rtol=0, atol=1e-5)


def test_lora_on_restored_weights_starts_as_them_and_freezes_them(tmp_path):
    hf_llama(tmp_path / "hf")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    plain = build_model(ours())
    load_pretrained(plain, str(tmp_path / "hf"))
    adapted = prepare_for_fine_tuning(build_model(ours()), restore_from_path=str(tmp_path / "hf"), seed=1,
                                      lora=LoraConfig(rank=2, alpha=4.0, dropout=0.0, target_modules=("q_proj",)))
    assert torch.equal(adapted(ids), plain(ids))
    assert all(".lora." in n for n, p in adapted.named_parameters() if p.requires_grad)


def test_starts_from_a_checkpoint_of_ours(tmp_path):
    source = build_model(ours(seed=99))
    location = write_full_checkpoint(str(tmp_path / "ckpt"), 7, dict(source.named_parameters()),
                                     config={"model": {"architecture": "llama"}})
    model = build_model(ours())
    load_pretrained(model, location)
    for (name, mine), (_, theirs) in zip(model.named_parameters(), source.named_parameters()):
        assert torch.equal(mine, theirs), name
    load_pretrained(model, str(tmp_path / "ckpt"))  # the directory of checkpoints: its newest


def test_weights_of_another_model_name_the_key(tmp_path):
    hf_llama(tmp_path / "hf", hidden=64)
    with pytest.raises(ValueError, match=r"^model\.restore_from_path: .* holds .*embed\.word\.weight\)? with "
                                         r"shape \(128, 64\) but the model config makes \(128, 32\)"):
        load_pretrained(build_model(ours()), str(tmp_path / "hf"))
    with pytest.raises(ValueError, match=r"^model\.restore_from_path: .*holds no complete checkpoint"):
        load_pretrained(build_model(ours()), str(tmp_path / "nothing"))


def test_a_lora_runs_adapters_alone_are_not_a_starting_point(tmp_path):
    adapters = {"layers.0.attn.qkv.lora.A.q_proj": torch.zeros(2, 32)}
    location = write_full_checkpoint(str(tmp_path / "lora"), 5, adapters, config={"model": {}})
    with pytest.raises(ValueError, match=r"a LoRA run saves its adapters only"):
        load_pretrained(build_model(ours()), location)


def test_starts_from_a_mistral_directory(tmp_path):
    """Mistral (v0.3: no sliding window) is Llama's layers under Llama's weight names: fine_tuning=mistral/7b."""
    config = transformers.MistralConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                        rope_theta=1e6, rms_norm_eps=1e-5, sliding_window=None, head_dim=8)
    torch.manual_seed(0)
    theirs = transformers.MistralForCausalLM(config).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.mul_(5.0) if p.dim() > 1 else p.add_(torch.randn(p.shape) * 0.1)
    theirs.save_pretrained(tmp_path / "mistral")
    model = build_model(ours(rotary_base=1e6))
    load_pretrained(model, str(tmp_path / "mistral"))
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), theirs(ids).logits, rtol=0, atol=1e-5)

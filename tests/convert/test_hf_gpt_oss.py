# GPT-OSS (runtime/families/gpt_oss) against transformers' own GptOssForCausalLM, built tiny and at random with
# everything that sets it apart non-trivial: attention sinks and biases, a sliding window (64) shorter than the
# sequence on layer 0, the router's and the experts' biases, expert weights large enough that the clamped SwiGLU
# clamps, YaRN with an original context (256) far shorter than the 1,100 tokens scored. Imported, our per-token
# log-probs are transformers'; exported, transformers loads it with no missing or unexpected key, gives our logits,
# and every tensor is bitwise the original.
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from runtime.convert import load_hf_directory, save_hf_directory
from runtime.models import ModelConfig, build_model
from runtime.models.layers import rope_attention_factor, rope_inverse_frequencies
from runtime.schema.model import RopeScaling, hf_model_keys

transformers = pytest.importorskip("transformers")

YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 256}
TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
            max_position_embeddings=2048, sliding_window=64, layer_types=["sliding_attention", "full_attention"],
            rope_parameters=YARN, bos_token_id=None, eos_token_id=None, pad_token_id=None)
TOKENS = 1100


def hf_model(**overrides):
    config = transformers.GptOssConfig(**{**TINY, **overrides})
    config._attn_implementation = "eager"  # GPT-OSS has no SDPA path in transformers
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 or name.endswith("_bias"):  # norms, sinks, every bias
                p.add_(torch.randn(p.shape, generator=gen) * 0.3)
            elif ".experts." in name:  # gate/up values well past swiglu_limit (7)
                p.normal_(0.0, 1.5, generator=gen)
            else:
                p.mul_(5.0)
    return model.eval()


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    hf = hf_model()
    directory = tmp_path_factory.mktemp("gpt_oss") / "original"
    hf.save_pretrained(directory)
    return hf, directory


def ours_from(directory):
    state, keys, _ = load_hf_directory(directory)
    cfg = ModelConfig.from_model_section(keys, tokenizer_vocab_size=128)
    model = build_model(cfg).eval()
    model.load_state_dict(state, strict=True)
    return model, state, cfg


def token_log_probs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits[:, :-1].double(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def test_imports_exactly(original):
    hf, directory = original
    model, _, cfg = ours_from(directory)
    assert cfg.architecture == "gpt_oss" and cfg.sliding_window == 64 and cfg.rope_scaling.rope_type == "yarn"
    assert cfg.layer_types == ("sliding_attention", "full_attention") and cfg.kv_channels == 16
    ids = torch.randint(0, 128, (1, TOKENS), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    assert (token_log_probs(ours, ids) - token_log_probs(theirs, ids)).abs().max().item() <= 2e-4
    # The window matters here: the same weights seen whole give other log-probs.
    full = hf_model(layer_types=["full_attention"] * 2)
    with torch.no_grad():
        assert (token_log_probs(full(ids).logits, ids) - token_log_probs(theirs, ids)).abs().max().item() > 1e-2


def test_exports_what_transformers_loads(original, tmp_path):
    hf, directory = original
    model, state, cfg = ours_from(directory)
    out = save_hf_directory(tmp_path / "export", state, cfg, None)
    again, info = transformers.GptOssForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    again.config._attn_implementation = "eager"
    ids = torch.randint(0, 128, (2, 200), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        assert torch.equal(again.eval()(ids).logits, hf(ids).logits)
        assert (model(ids) - again(ids).logits).abs().max().item() <= 1e-5
    before, after = load_file(directory / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(before) == sorted(after)
    assert all(torch.equal(before[name], after[name]) for name in before)
    config = json.loads((out / "config.json").read_text())
    assert config["rope_parameters"] == YARN and config["layer_types"] == TINY["layer_types"]


@pytest.mark.parametrize("scaling", [
    dict(factor=8.0, original_max_position_embeddings=256, truncate=False),
    dict(factor=32.0, original_max_position_embeddings=4096, beta_fast=16.0, beta_slow=2.0),  # truncated ramp
    dict(factor=40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=0.707),  # DeepSeek-V3's
    dict(factor=4.0, original_max_position_embeddings=512, attention_factor=1.25),
])
def test_yarn_matches_transformers(scaling):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.GptOssConfig(**{**TINY, "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0,
                                                                      **scaling}})
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    keys = hf_model_keys(config.to_dict())
    ours = RopeScaling(**keys["rope_scaling"])
    assert rope_attention_factor(ours) == pytest.approx(factor, rel=1e-12)
    assert torch.allclose(rope_inverse_frequencies(16, keys["rotary_base"], ours).float(), inv_freq, rtol=1e-6)


def test_quantized_weights_refused_in_one_line():
    config = transformers.GptOssConfig(**TINY).to_dict()
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router"]}
    with pytest.raises(ValueError, match=r"^config.json quantization_config \(quant_method 'mxfp4'\): [^\n]*$"):
        hf_model_keys(config)


def test_a_rank_reads_its_experts_and_columns_by_slices(original):
    """What a rank holding experts 1 and 3 (ep2) and half of each expert's interleaved gate/up pairs (tp2) reads
    straight from the safetensors file: exactly those values of the full tensors."""
    from runtime.convert.hf import SlicedReader

    _, directory = original
    _, state, cfg = ours_from(directory)
    reader = SlicedReader(directory, cfg)
    assert reader.available
    reader.check()
    experts, columns = torch.tensor([1, 3]), torch.arange(16, 32)
    gate_up = reader.read("layers.1.mlp.gate_up", {0: experts, 2: columns})
    assert torch.equal(gate_up, state["layers.1.mlp.gate_up"][experts][:, :, columns])
    bias = reader.read("layers.1.mlp.gate_up_bias", {0: experts, 1: columns})
    assert torch.equal(bias, state["layers.1.mlp.gate_up_bias"][experts][:, columns])
    heads = torch.tensor([2, 3])
    assert torch.equal(reader.read("layers.0.attn.sinks", {0: heads}), state["layers.0.attn.sinks"][heads])


def test_lora_exports_merged_and_as_a_peft_adapter(original, tmp_path):
    """Adapters on GPT-OSS's biased q, k, v and o: merged, transformers computes our adapted logits; as a PEFT
    adapter over the imported directory, peft does."""
    peft = pytest.importorskip("peft")
    from runtime.convert.peft import save_adapter, to_peft
    from runtime.models.lora import merge_lora
    from runtime.schema.training_config import LoraConfig
    from tests.convert.test_peft_export import with_random_adapters

    _, directory = original
    model, _, cfg = ours_from(directory)
    lora = LoraConfig(rank=4, alpha=8.0, dropout=0.0, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"))
    with_random_adapters(model, lora)
    ids = torch.randint(0, 128, (2, 200), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        ours = model.eval()(ids)
    save_hf_directory(tmp_path / "merged", merge_lora(model.state_dict(), cfg, lora.scale), cfg, None)
    merged = transformers.GptOssForCausalLM.from_pretrained(tmp_path / "merged").eval()
    merged.config._attn_implementation = "eager"
    state, config = to_peft(model.state_dict(), cfg, lora, base_model_name_or_path=str(directory))
    save_adapter(tmp_path / "adapter", state, config)
    base = transformers.GptOssForCausalLM.from_pretrained(directory)
    base.config._attn_implementation = "eager"
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    scale = ours.abs().max().item()  # relative to the largest logit, as test_hf_families.py compares
    with torch.no_grad():
        assert (merged(ids).logits - ours).abs().max().item() <= 1e-5 * scale
        assert (adapted(ids).logits - ours).abs().max().item() <= 1e-5 * scale
        assert (transformers.GptOssForCausalLM.from_pretrained(directory).eval()(ids).logits - ours).abs().max() > 1e-2


def test_generates_what_transformers_generates(tmp_path):
    """Greedy decoding through our KV cache (a batch of two prompts, left-padded) with a window of 8, which the
    prompts and the new tokens both cross: each row's tokens are transformers' for that prompt alone."""
    from runtime.generate import generate

    hf = hf_model(sliding_window=8)
    hf.save_pretrained(tmp_path / "hf")
    model, _, _ = ours_from(tmp_path / "hf")
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (30, 21)]
    with torch.no_grad():
        ours = generate(model, prompts, max_new_tokens=20, vocab_size=128)
        for prompt, tokens in zip(prompts, ours):
            theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)[0, len(prompt):]
            assert tokens == theirs.tolist()


def test_absent_keys_take_gpt_oss_config_defaults():
    """A config.json without head_dim, num_key_value_heads, rope settings, layer_types or sliding_window reads them
    as GptOssConfig does (64, 8, YaRN x32 over 4096, sliding first then alternating, 128), not as a Llama's."""
    config = {key: value for key, value in transformers.GptOssConfig(**TINY).to_dict().items()
              if key not in ("head_dim", "num_key_value_heads", "rope_parameters", "rope_scaling", "rope_theta",
                             "layer_types", "sliding_window")}
    theirs = transformers.GptOssConfig(**config)
    keys = hf_model_keys(config)
    assert keys["kv_channels"] == theirs.head_dim == 64 and keys["num_query_groups"] == theirs.num_key_value_heads
    assert keys["layer_types"] == theirs.layer_types and keys["sliding_window"] == theirs.sliding_window
    assert keys["rotary_base"] == theirs.rope_parameters["rope_theta"]
    scaling = {k: v for k, v in keys["rope_scaling"].items() if v is not None}
    assert scaling == {k: v for k, v in theirs.rope_parameters.items() if k != "rope_theta"}

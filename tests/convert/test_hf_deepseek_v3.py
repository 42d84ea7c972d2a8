# DeepSeek-V3 (runtime/families/deepseek_v3) against transformers' own DeepseekV3ForCausalLM, built tiny and at
# random with everything that sets it apart non-trivial: multi-head latent attention (low-rank q with its norm, or
# one q projection; the kv latent, its norm and the shared rotated key; interleaved RoPE pairs), YaRN with
# DeepSeek's mscale / mscale_all_dim (softmax scale and cos/sin) over an original context (256) far shorter than
# the 1,100 tokens scored, a dense first layer, then MoE layers with sigmoid scores, a selection bias
# (e_score_correction_bias) large enough to change the choice, group-limited top-2 (2 groups, 1 kept), the
# routed scaling factor and a shared expert. Imported, our per-token log-probs are transformers'; exported,
# transformers loads it with no missing or unexpected key, gives our logits, and every tensor is bitwise the
# original.
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from runtime.convert import save_hf_directory
from runtime.schema.model import hf_model_keys
from tests.convert.test_hf_gpt_oss import ours_from, token_log_probs

transformers = pytest.importorskip("transformers")

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale": 1.0, "mscale_all_dim": 0.8, "original_max_position_embeddings": 256}
TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=8, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
            routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12,
            qk_nope_head_dim=16, n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
            norm_topk_prob=True, max_position_embeddings=2048, rope_parameters=YARN, bos_token_id=None,
            eos_token_id=None, pad_token_id=None)
TOKENS = 1100


def hf_model(**overrides):
    config = transformers.DeepseekV3Config(**{**TINY, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # every norm
                p.add_(torch.randn(p.shape, generator=gen) * 0.3)
            else:
                p.mul_(5.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.3)
    return model.eval()


@pytest.fixture(scope="module", params=[24, None], ids=["q_lora", "q_proj"])
def original(request, tmp_path_factory):
    hf = hf_model(q_lora_rank=request.param)
    directory = tmp_path_factory.mktemp("deepseek_v3") / "original"
    hf.save_pretrained(directory)
    return hf, directory


def test_imports_exactly(original):
    hf, directory = original
    model, _, cfg = ours_from(directory)
    assert cfg.architecture == "deepseek_v3" and cfg.rope_scaling.mscale_all_dim == 0.8
    assert cfg.moe.layers == (1, 2) and cfg.moe.groups == 2 and cfg.moe.shared_ffn_hidden_size == 8
    ids = torch.randint(0, 128, (1, TOKENS), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    assert (token_log_probs(ours, ids) - token_log_probs(theirs, ids)).abs().max().item() <= 2e-4
    # The selection bias matters here: without it transformers picks other experts and other log-probs.
    for name, b in hf.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.zero_()
    with torch.no_grad():
        assert (token_log_probs(hf(ids).logits, ids) - token_log_probs(theirs, ids)).abs().max().item() > 1e-2


def test_exports_what_transformers_loads(original, tmp_path):
    hf, directory = original
    model, state, cfg = ours_from(directory)
    out = save_hf_directory(tmp_path / "export", state, cfg, None)
    again, info = transformers.DeepseekV3ForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    again.config._attn_implementation = "eager"
    reference = transformers.DeepseekV3ForCausalLM.from_pretrained(directory).eval()
    reference.config._attn_implementation = "eager"
    ids = torch.randint(0, 128, (2, 200), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        assert torch.equal(again.eval()(ids).logits, reference(ids).logits)
        assert (model(ids) - again(ids).logits).abs().max().item() <= 1e-4
    before, after = load_file(directory / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(before) == sorted(after)
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_quantized_weights_refused_in_one_line():
    config = transformers.DeepseekV3Config(**TINY).to_dict()
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    with pytest.raises(ValueError, match=r"^config.json quantization_config \(quant_method 'fp8'\): [^\n]*$"):
        hf_model_keys(config)


def test_reads_fused_experts_and_ignores_multi_token_prediction(original, tmp_path):
    """transformers 5's fused expert tensors (save_original_format=False) read as the per-expert ones, and a
    multi-token prediction layer (past the decoder's, with its eh_proj) ignored with a note, as transformers does."""
    from safetensors.torch import save_file

    from runtime.convert.hf import from_hf

    hf, directory = original
    _, state, _ = ours_from(directory)
    before = load_file(directory / "model.safetensors")
    fused = {name: t for name, t in before.items() if ".mlp.experts." not in name}
    for i in (1, 2):
        h = f"model.layers.{i}.mlp.experts."
        fused[h + "gate_up_proj"] = torch.stack([torch.cat([before[f"{h}{e}.gate_proj.weight"],
                                                            before[f"{h}{e}.up_proj.weight"]]) for e in range(8)])
        fused[h + "down_proj"] = torch.stack([before[f"{h}{e}.down_proj.weight"] for e in range(8)])
    fused.update({"model.layers.3.eh_proj.weight": torch.zeros(32, 64), "model.layers.3.enorm.weight": torch.ones(32)})
    ours, _ = from_hf(fused, hf.config.to_dict(), tokenizer_vocab_size=128)
    assert ours.keys() == state.keys() and all(torch.equal(ours[name], state[name]) for name in state)


def test_group_limited_routing_refused_when_it_cannot_hold_top_k():
    from runtime.schema.model import MoEConfig, ModelConfig

    moe = MoEConfig(num_experts=8, top_k=5, layers=(0,), router_activation="sigmoid", groups=2, top_groups=1)
    with pytest.raises(ValueError, match=r"model\.moe\.top_k: 5 is more than the 4 experts of top_groups \(1\) "
                                         r"groups; raise top_groups"):
        ModelConfig(architecture="deepseek_v3", vocab_size=128, hidden_size=32, num_layers=1, num_attention_heads=4,
                    ffn_hidden_size=48, max_position_embeddings=64, moe=moe)


def test_generation_refused_in_one_line(original):
    """Generation's KV cache is not built for latent attention: refused in one line."""
    from runtime.generate import generate

    _, directory = original
    model, _, _ = ours_from(directory)
    with pytest.raises(ValueError, match=r"^generation: multi-head latent attention \(model\.architecture="
                                         r"deepseek_v3\) has no KV cache here[^\n]*$"):
        generate(model, [[1, 2, 3]], max_new_tokens=2, vocab_size=128)


def _lora(targets, cfg, stage="peft."):
    """model.peft with these target_modules on the model `cfg`, as the schema parses it: (LoRA, errors)."""
    from runtime.schema.reader import Report, Section
    from runtime.schema.training import parse_lora

    report = Report()
    peft = {"peft": {"peft_scheme": "lora", "lora_rank": 4, "target_modules": list(targets)}}
    lora = parse_lora(Section(peft, "model", report), cfg.architecture, stage, cfg.latent_attention)
    return lora, report.errors


def test_lora_targets_latent_attention_by_hugging_face_names(original):
    """The usual groups name the latent attention's projections (its queries' by q_lora_rank); a name it does not
    have is refused in one line naming the key and the valid names; adapters on experts stay refused."""
    from runtime.schema import rules

    _, directory = original
    _, _, cfg = ours_from(directory)
    queries = ["q_proj"] if cfg.latent_attention.q_lora_rank is None else ["q_a_proj", "q_b_proj"]
    assert _lora(["qkv_proj"], cfg)[0].target_modules == (*queries, "kv_a_proj_with_mqa", "kv_b_proj")
    assert _lora(["attention_qkv", "attention_dense"], cfg)[0].target_modules == (
        *queries, "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
    assert _lora(["kv_b_proj", *queries], cfg)[0].target_modules == ("kv_b_proj", *queries)
    valid = (f"valid: {', '.join(queries)}, kv_a_proj_with_mqa, kv_b_proj, o_proj, gate_proj, up_proj, down_proj, "
             f"qkv_proj, attention_qkv, attention_dense, mlp_fc1, mlp_fc2, all_linear")
    missing = ["k_proj", "q_a_proj" if queries == ["q_proj"] else "q_proj"]
    for name in missing:
        lora, errors = _lora(["o_proj", name], cfg)
        assert lora is None and len(errors) == 1 and "\n" not in errors[0], errors
        assert errors[0].startswith(f"peft.model.peft.target_modules: {name!r} is not a projection of this multi-head "
                                    f"latent attention (model.latent_attention")
        assert errors[0].endswith(valid), errors[0]
    mlp = _lora(["all_linear"], cfg)[0].target_modules
    assert rules.lora_moe(cfg.moe.num_experts, mlp, "peft.", cfg.latent_attention) == (
        f"peft.model.peft.target_modules: gate_proj, up_proj, down_proj on a mixture-of-experts model: adapters on "
        f"experts are not built; adapt the attention projections only ({', '.join(queries)}, kv_a_proj_with_mqa, "
        f"kv_b_proj, o_proj: qkv_proj and attention_dense name them)")


def test_lora_exports_merged_and_as_a_peft_adapter(original, tmp_path):
    """Adapters on every latent-attention projection (q_a / q_b or q, kv_a, kv_b, o): merged, transformers loads it
    with no missing or unexpected key and computes our adapted logits; as a PEFT adapter over the original
    directory, peft does."""
    peft = pytest.importorskip("peft")
    from runtime.convert.peft import save_adapter, to_peft
    from runtime.models import build_model
    from runtime.models.lora import merge_lora
    from tests.convert.test_peft_export import with_random_adapters

    _, directory = original
    model, _, cfg = ours_from(directory)
    lora = _lora(["qkv_proj", "attention_dense"], cfg)[0]
    assert len(lora.target_modules) in (4, 5)
    with_random_adapters(model, lora)
    ids = torch.randint(0, 128, (2, 200), generator=torch.Generator().manual_seed(9))
    folded = merge_lora(model.state_dict(), cfg, lora.scale)
    ours_merged = build_model(cfg).eval()
    ours_merged.load_state_dict(folded)
    with torch.no_grad():
        ours, ours_folded = model.eval()(ids), ours_merged(ids)
    save_hf_directory(tmp_path / "merged", folded, cfg, None)
    merged, info = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "merged", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    state, config = to_peft(model.state_dict(), cfg, lora, base_model_name_or_path=str(directory))
    assert config["target_modules"] == sorted(lora.target_modules)
    save_adapter(tmp_path / "adapter", state, config)
    adapted = peft.PeftModel.from_pretrained(transformers.DeepseekV3ForCausalLM.from_pretrained(directory),
                                             tmp_path / "adapter").eval()
    base = transformers.DeepseekV3ForCausalLM.from_pretrained(directory).eval()
    for hf in (merged, adapted, base):
        hf.config._attn_implementation = "eager"
    with torch.no_grad():  # within 1e-4, as test_exports_what_transformers_loads compares this family
        assert (merged.eval()(ids).logits - ours_folded).abs().max().item() <= 1e-4
        assert (adapted(ids).logits - ours).abs().max().item() <= 1e-4
        # Folding B A into the weights rounds differently in fp32 (a few 1e-5 here: large random weights).
        assert (ours_folded - ours).abs().max().item() <= 1e-4
        assert (base(ids).logits - ours).abs().max().item() > 1e-2  # the adapters matter

"""The plain models: deterministic layout-free init, the loss path, and equality with Hugging Face's reference
implementations of the same architectures (GPT2LMHeadModel, LlamaForCausalLM) given the same weights."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runtime.models import ModelConfig, build_model, padded_vocab_size
from runtime.parallel import ParallelDims, Topology, parallelize_model
from tests.runtime_parallel import harness as H

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_init_depends_only_on_config(arch):
    a, b = build_model(H.tiny_config(arch)), build_model(H.tiny_config(arch))
    assert a.state_dict().keys() == b.state_dict().keys()
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    c = build_model(H.tiny_config(arch, seed=99))
    assert not torch.equal(a.embed.word.weight, c.embed.word.weight)
    torch.manual_seed(0)
    before = torch.rand(1)
    torch.manual_seed(0)
    build_model(H.tiny_config(arch))
    assert torch.equal(torch.rand(1), before), "building a model leaves the global RNG alone"


def test_init_scales_residual_outputs_and_ties_gpt_embeddings():
    cfg = H.tiny_config("gpt", hidden_size=256, ffn_hidden_size=1024, num_attention_heads=4, num_layers=8)
    model = build_model(cfg)
    assert model.output.weight is model.embed.word.weight
    assert model.layers[0].attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.layers[0].mlp.fc2.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)  # / sqrt(2 * 8)
    assert torch.all(model.layers[0].attn.qkv.bias == 0) and torch.all(model.final_norm.weight == 1)


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_loss_path_equals_cross_entropy_of_logits(arch):
    model = build_model(H.tiny_config(arch))
    input_ids, labels, _ = H.global_batch(128, step=0)
    logits = model(input_ids)
    assert logits.shape == (*input_ids.shape, 128)
    expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)
    torch.testing.assert_close(model(input_ids, labels), expected)


@pytest.mark.parametrize("arch", ["gpt", "llama"])
@pytest.mark.parametrize("granularity,modules", [("full", ()), ("selective", ("core_attention",)),
                                                 ("selective", ("core_attention", "mlp"))])
def test_activation_checkpointing_gives_identical_loss_and_grads(arch, granularity, modules):
    topo = Topology.build(ParallelDims(1, 1, 1, 1))
    plain = build_model(H.tiny_config(arch))
    ckpt = parallelize_model(build_model(H.tiny_config(arch)), topo, activation_checkpointing=granularity,
                             recompute_modules=modules)
    input_ids, labels, _ = H.global_batch(128, step=0)
    losses = []
    for model in (plain, ckpt):
        loss = model(input_ids, labels).mean()
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == losses[1]
    assert plain.state_dict().keys() == ckpt.state_dict().keys(), "checkpointing keeps parameter names"
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match="model.architecture: 'bert' is not one of gpt, llama, gemma3, gpt_oss"):
        H.tiny_config("gpt", architecture="bert")
    with pytest.raises(ValueError, match="model.num_query_groups: 3 does not divide num_attention_heads 4"):
        H.tiny_config("llama", num_query_groups=3)
    with pytest.raises(ValueError, match="model.hidden_size: 30 is not divisible by num_attention_heads 4"):
        H.tiny_config("gpt", hidden_size=30)


def test_parallel_layout_errors_name_the_key():
    from runtime.parallel import check_tensor_parallel

    with pytest.raises(ValueError, match="model.num_attention_heads: 4 is not divisible by tensor_model_parallel_size 3"):
        check_tensor_parallel(H.tiny_config("gpt"), 3)
    with pytest.raises(ValueError, match="num_query_groups: 4 KV heads can be neither split over nor replicated to tensor_model_parallel_size 6"):
        check_tensor_parallel(H.tiny_config("llama", vocab_size=384, hidden_size=48, num_attention_heads=12,
                                            num_query_groups=4), 6)
    topo = Topology.build(ParallelDims(1, 1, 1, 1))
    with pytest.raises(ValueError, match="activations_checkpoint_granularity: 'some' is not one of null, full, selective"):
        parallelize_model(build_model(H.tiny_config("gpt")), topo, activation_checkpointing="some")
    with pytest.raises(ValueError, match="activations_checkpoint_recompute: 'layernorm' is not one of core_attention, mlp"):
        parallelize_model(build_model(H.tiny_config("gpt")), topo, activation_checkpointing="selective",
                          recompute_modules=["layernorm"])


def test_padded_vocab_and_config_from_model_section():
    assert padded_vocab_size(50257, 128) == 50304
    assert padded_vocab_size(256, 128) == 256
    section = {"architecture": "llama", "hidden_size": 64, "num_layers": 2, "num_attention_heads": 4,
               "num_query_groups": None, "ffn_hidden_size": 176, "max_position_embeddings": 32,
               "make_vocab_size_divisible_by": 128, "micro_batch_size": 4, "seed": 7}
    cfg = ModelConfig.from_model_section(section, tokenizer_vocab_size=1000)
    assert (cfg.vocab_size, cfg.kv_heads, cfg.seed) == (1024, 4, 7)


def _gpt2_reference(model):
    cfg = model.cfg
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.max_position_embeddings, n_embd=cfg.hidden_size,
        n_layer=cfg.num_layers, n_head=cfg.num_attention_heads, n_inner=cfg.ffn_hidden_size,
        activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        layer_norm_epsilon=cfg.layernorm_epsilon, tie_word_embeddings=True))
    ours = model.state_dict()
    state = {"transformer.wte.weight": ours["embed.word.weight"], "transformer.wpe.weight": ours["embed.position.weight"],
             "transformer.ln_f.weight": ours["final_norm.weight"], "transformer.ln_f.bias": ours["final_norm.bias"]}
    for i in range(cfg.num_layers):
        o, h = f"layers.{i}.", f"transformer.h.{i}."
        for hf_name, our_name in [("ln_1", "attn_norm"), ("ln_2", "mlp_norm")]:
            state[h + hf_name + ".weight"], state[h + hf_name + ".bias"] = ours[o + our_name + ".weight"], ours[o + our_name + ".bias"]
        # HF's Conv1D stores (in, out): the transpose of nn.Linear.
        for hf_name, our_name in [("attn.c_attn", "attn.qkv"), ("attn.c_proj", "attn.proj"), ("mlp.c_fc", "mlp.fc1"),
                                  ("mlp.c_proj", "mlp.fc2")]:
            state[h + hf_name + ".weight"] = ours[o + our_name + ".weight"].t()
            state[h + hf_name + ".bias"] = ours[o + our_name + ".bias"]
    hf.load_state_dict(state, strict=False)
    hf.tie_weights()
    return hf


def _llama_reference(model):
    cfg = model.cfg
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.kv_heads, max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rotary_base, rms_norm_eps=cfg.layernorm_epsilon, tie_word_embeddings=False,
        attention_bias=False, mlp_bias=False))
    ours = model.state_dict()
    nq, nkv, ffn = cfg.num_attention_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.ffn_hidden_size
    state = {"model.embed_tokens.weight": ours["embed.word.weight"], "model.norm.weight": ours["final_norm.weight"],
             "lm_head.weight": ours["output.weight"]}
    for i in range(cfg.num_layers):
        o, h = f"layers.{i}.", f"model.layers.{i}."
        q, k, v = ours[o + "attn.qkv.weight"].split([nq, nkv, nkv])
        gate, up = ours[o + "mlp.gate_up.weight"].split([ffn, ffn])
        state.update({h + "self_attn.q_proj.weight": q, h + "self_attn.k_proj.weight": k,
                      h + "self_attn.v_proj.weight": v, h + "self_attn.o_proj.weight": ours[o + "attn.proj.weight"],
                      h + "mlp.gate_proj.weight": gate, h + "mlp.up_proj.weight": up,
                      h + "mlp.down_proj.weight": ours[o + "mlp.down.weight"],
                      h + "input_layernorm.weight": ours[o + "attn_norm.weight"],
                      h + "post_attention_layernorm.weight": ours[o + "mlp_norm.weight"]})
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return hf


@pytest.mark.parametrize("arch,reference", [("gpt", _gpt2_reference), ("llama", _llama_reference)])
def test_logits_equal_hugging_face_reference(arch, reference):
    model = build_model(H.tiny_config(arch))
    # Random non-trivial norms and biases, so a mis-mapped LayerNorm/bias would show.
    with torch.no_grad():
        gen = torch.Generator().manual_seed(3)
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    hf = reference(model).eval()
    input_ids, _, _ = H.global_batch(128, step=0)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids), hf(input_ids).logits, rtol=1e-4, atol=1e-5)

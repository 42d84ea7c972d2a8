"""The model's own subsections in a training stage config, with Hugging Face's or NxD Training's keys:
model.rope_scaling, model.latent_attention and model.moe, each read into its typed config (runtime/schema/model.py)."""
from __future__ import annotations

from runtime.schema import choices as C
from runtime.schema import rules
from runtime.schema.model import LatentAttention, MoEConfig, RopeScaling
from runtime.schema.reader import Section


def parse_rope_scaling(model: Section) -> RopeScaling | None:
    """model.rope_scaling with Hugging Face's keys (a Llama 3.1 config.json's rope_scaling); absent or null: none."""
    if model.raw("rope_scaling", None) is None:
        return None
    s = model.section("rope_scaling")
    rope_type = s.choice("rope_type", C.ROPE_SCALING_TYPES)
    values = dict(factor=s.float("factor", minimum=0.0))
    if rope_type == "llama3":
        values.update(low_freq_factor=s.float("low_freq_factor", 1.0, minimum=0.0),
                      high_freq_factor=s.float("high_freq_factor", 4.0, minimum=0.0),
                      original_max_position_embeddings=s.int("original_max_position_embeddings", minimum=1))
    if rope_type == "yarn":
        values.update(original_max_position_embeddings=s.int("original_max_position_embeddings", minimum=1),
                      beta_fast=s.float("beta_fast", 32.0, minimum=0.0), beta_slow=s.float("beta_slow", 1.0,
                                                                                            minimum=0.0),
                      truncate=s.bool("truncate", True))
        optional = {key: s.float(key, None, minimum=0.0) for key in ("mscale", "mscale_all_dim", "attention_factor")}
        values.update({key: value for key, value in optional.items() if value is not None})
    if rope_type is None or any(v is None for v in values.values()):
        return None  # reported
    scaling = RopeScaling(rope_type=rope_type, **values)
    for problem in rules.rope_scaling(scaling, s.path):
        model.report.error(problem)
    return scaling


def parse_latent_attention(model: Section) -> LatentAttention | None:
    """model.latent_attention (multi-head latent attention) with Hugging Face's keys; absent or null: none."""
    if model.raw("latent_attention", None) is None:
        return None
    s = model.section("latent_attention")
    values = {key: s.int(key, minimum=1) for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                                    "v_head_dim")}
    values.update(q_lora_rank=s.int("q_lora_rank", None, minimum=1), rope_interleave=s.bool("rope_interleave", True))
    if any(v is None for k, v in values.items() if k != "q_lora_rank"):
        return None  # reported
    return LatentAttention(**values)


def parse_moe(model: Section) -> MoEConfig | None:
    """model.moe with NxD Training's keys; absent, null or num_experts 0: a dense model."""
    if model.raw("moe", None) is None:
        return None
    s = model.section("moe")
    num_experts = s.int("num_experts", 0, minimum=0)
    rate = s.float("router_bias_update_rate", 0.0, minimum=0.0)
    if not num_experts:
        if rate:
            model.report.error(f"{s.key('router_bias_update_rate')}: {rate} updates the expert selection bias of MoE "
                               f"layers, which a dense model (num_experts {num_experts}) has none of; set it to 0.0")
        return None
    values = dict(top_k=s.int("top_k", 2), frequency=s.int("frequency", 1),
                  capacity_factor=s.float("capacity_factor", None), dropless=s.bool("dropless", False),
                  router_aux_loss_coef=s.float("router_aux_loss_coef", 0.0, minimum=0.0),
                  router_z_loss_coef=s.float("router_z_loss_coef", 0.0, minimum=0.0),
                  normalize_top_k_affinities=s.bool("normalize_top_k_affinities", True),
                  router_activation=s.str("router_activation", "softmax"),
                  ffn_hidden_size=s.int("ffn_hidden_size", None, minimum=1), layers=s.raw("layers", None),
                  score_bias=s.bool("score_bias", False), groups=s.int("groups", 1, minimum=1),
                  top_groups=s.int("top_groups", 1, minimum=1),
                  routed_scaling_factor=s.float("routed_scaling_factor", 1.0, minimum=0.0),
                  shared_ffn_hidden_size=s.int("shared_ffn_hidden_size", None, minimum=1),
                  router_bias_update_rate=rate)
    optional = ("capacity_factor", "ffn_hidden_size", "layers", "shared_ffn_hidden_size")
    if any(v is None for k, v in values.items() if k not in optional):
        return None  # reported
    if values["layers"] is not None:
        if not isinstance(values["layers"], (list, tuple)) or not all(isinstance(i, int) for i in values["layers"]):
            model.report.error(f"{s.key('layers')}: {values['layers']!r} must be a list of layer indexes")
            return None
        values["layers"] = tuple(values["layers"])
    dropless = values.pop("dropless")
    if dropless:
        values["capacity_factor"] = None  # NxD Training's dropless: no capacity, whatever capacity_factor says
    return MoEConfig(num_experts=num_experts, **values)

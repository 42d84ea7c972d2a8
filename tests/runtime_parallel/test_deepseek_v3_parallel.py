"""DeepSeek-V3 (runtime/families/deepseek_v3) trains under tp2 (with and without sequence parallelism), ep2 and pp2,
and its LoRA adapters under tp2, exactly as one process does: gloo processes on CPU, fp32; per step the loss and
grad norm within 1e-5 relative, and the parameters after the steps (q / q_b and kv_b split by head, proj by head
column, the low-rank a-projections and their norms whole, experts by expert and hidden unit, router and shared
expert whole) within 1e-5. One spawn for tp/ep, one for pp."""
from __future__ import annotations

import dataclasses

import pytest

from runtime.schema.model import LatentAttention, MoEConfig, RopeScaling
from tests.runtime_parallel import harness as H
from tests.runtime_parallel.test_gpt_oss_parallel import layout_suite
from tests.runtime_pipeline import harness as P

L = H.Layout
# MLA with a low-rank q (12), a kv latent of 16, heads of 8 unrotated + 4 rotated q/k channels and 12 value
# channels, YaRN with DeepSeek's mscale_all_dim; layer 0 dense, then sigmoid-scored experts with a selection bias,
# 2 groups of which 1 is eligible, top-2, scaled by 2.5, and a shared expert.
DEEPSEEK = dict(architecture="deepseek_v3", kv_channels=12,
                latent_attention=LatentAttention(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                                 v_head_dim=12, q_lora_rank=12),
                rope_scaling=RopeScaling("yarn", 4.0, original_max_position_embeddings=4, mscale=1.0,
                                         mscale_all_dim=0.7),
                moe=MoEConfig(num_experts=4, top_k=2, layers=(1,), ffn_hidden_size=16, router_activation="sigmoid",
                              score_bias=True, groups=2, top_groups=1, routed_scaling_factor=2.5,
                              shared_ffn_hidden_size=16, router_aux_loss_coef=0.02))
PLAIN_Q = {**DEEPSEEK, "latent_attention": dataclasses.replace(DEEPSEEK["latent_attention"], q_lora_rank=None)}
JOBS = {
    "deepseek-tp2": ("llama", DEEPSEEK, L(tp=2)),
    "deepseek-tp2-sp": ("llama", DEEPSEEK, L(tp=2, sequence_parallel=True)),
    "deepseek-q-tp2-sp": ("llama", PLAIN_Q, L(tp=2, sequence_parallel=True)),
    "deepseek-ep2": ("llama", DEEPSEEK, L(dp=2, ep=2)),
    # LoRA on every latent-attention projection: q_a and kv_a whole on each rank (their adapters' gradients summed
    # over TP), q_b and kv_b by head rows (B split, A whole), o_proj by head columns (A split, B whole).
    "deepseek-lora-tp2-sp": ("llama", {**DEEPSEEK, "fine_tuning": "lora"}, L(tp=2, sequence_parallel=True)),
    "deepseek-q-lora-tp2": ("llama", {**PLAIN_Q, "fine_tuning": "lora"}, L(tp=2)),
}
PIPELINE = {**DEEPSEEK, "moe": dataclasses.replace(DEEPSEEK["moe"], layers=tuple(range(1, P.NUM_LAYERS)))}
PIPELINE_JOBS = {"deepseek-pp2": ("llama", PIPELINE, P.PipelineLayout(pp=2))}


globals().update(layout_suite(JOBS, PIPELINE_JOBS, PIPELINE))


@pytest.mark.parametrize("context, key", [("ring", "context_parallel_size"), ("ulysses", "ulysses_parallel_size")])
def test_context_parallel_refused_in_one_line(context, key):
    from runtime.models import build_model
    from runtime.parallel import ParallelDims, Topology, parallelize_model

    topo = Topology.offline(ParallelDims(tp=1, pp=1, dp=2, world_size=2, cp=2), rank=0)  # refused before any group
    with pytest.raises(ValueError, match=rf"^training\.model\.{key}: 2 with multi-head latent attention[^\n]*$"):
        parallelize_model(build_model(H.tiny_config("llama", **DEEPSEEK)), topo, context=context)

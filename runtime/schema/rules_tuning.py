"""The fine-tuning and alignment rules: LoRA's rank, scale and target projections, document separation and
packing, which stage trains what, and preference alignment (DPO, ORPO). Rules as runtime/schema/rules.py
describes them; callers use them as rules.<name>."""
from __future__ import annotations

from runtime.schema.families import known_architecture


# ------------------------------------------------------------------------------------------------ fine-tuning
def lora_rank(rank: int, p: str) -> str | None:
    if rank <= 0:
        return f"{p}model.peft.lora_rank: {rank} must be a positive integer (8, 16 and 32 are usual)"
    return None


def lora_alpha(alpha: float, p: str) -> str | None:
    if alpha <= 0:
        return f"{p}model.peft.lora_alpha: {alpha} must be > 0 (the adapters' scale is lora_alpha / lora_rank)"
    return None


def lora_dropout(value: float, p: str) -> str | None:
    if not 0.0 <= value < 1.0:
        return f"{p}model.peft.lora_dropout: {value} must be in [0, 1)"
    return None


_MLP_MODULES = ("gate_proj", "up_proj", "down_proj")


def lora_modules(architecture: str | None, latent=None) -> tuple[str, ...]:
    """The projections LoRA can adapt on a model, by Hugging Face name (groups aside). Multi-head latent attention
    (`latent`: model.latent_attention) has its own, its queries' by q_lora_rank; where it is not known whether the
    model has it (no architecture, or one that may have it, without its latent_attention): both kinds' names."""
    from runtime.schema.choices import LATENT_LORA_MODULES, LATENT_LORA_PARTS, LORA_MODULES

    network = known_architecture(architecture)  # an unknown one: a gate assumed, its own key names it
    mlp = _MLP_MODULES if network is None or network.gated_mlp else _MLP_MODULES[1:]
    if latent is not None:
        queries = ("q_proj",) if latent.q_lora_rank is None else ("q_a_proj", "q_b_proj")
        return tuple(m for m in LATENT_LORA_MODULES if m in queries or m not in LATENT_LORA_PARTS["q_proj"]) + mlp
    attention = tuple(m for m in LORA_MODULES if m not in _MLP_MODULES)
    if network is None or "latent_attention" in network.switches:
        attention = tuple(dict.fromkeys(attention + LATENT_LORA_MODULES))
    return attention + mlp


def lora_targets(names: tuple[str, ...], architecture: str | None, p: str, latent=None) -> str | None:
    """The projections LoRA adapts, by Hugging Face name, or a group of them; GPT's MLP has no gate (its fc1 is
    up_proj); multi-head latent attention has no k_proj / v_proj, and q_proj only without q_lora_rank."""
    from runtime.schema.choices import LORA_GROUPS
    from runtime.schema.reader import closest

    key = f"{p}model.peft.target_modules"
    modules = lora_modules(architecture, latent)
    if not names:
        return f"{key}: empty; name the projections to adapt, e.g. [qkv_proj] (valid: {', '.join(modules)})"
    valid = modules + tuple(LORA_GROUPS)
    for name in names:
        if name == "gate_proj" and name not in modules:
            return f"{key}: gate_proj: GPT's MLP has no gate projection; adapt up_proj / down_proj (fc1 / fc2)"
        if name in valid:
            continue
        if latent is None:
            return (f"{key}: {name!r} is not a projection LoRA can adapt; {closest(name, valid)}valid: "
                    f"{', '.join(valid)}")
        queries = "one q_proj (q_lora_rank null)" if latent.q_lora_rank is None else \
            f"q_a_proj and q_b_proj (q_lora_rank {latent.q_lora_rank})"
        return (f"{key}: {name!r} is not a projection of this multi-head latent attention (model.latent_attention: "
                f"no k_proj / v_proj; queries through {queries}); {closest(name, valid)}valid: {', '.join(valid)}")
    return None


def lora_moe(num_experts: int | None, targets: tuple[str, ...], p: str, latent=None) -> str | None:
    mlp = [t for t in targets if t in _MLP_MODULES]
    if num_experts and mlp:
        attention = [m for m in lora_modules(None, latent) if m not in _MLP_MODULES] if latent is not None else \
            ["q_proj", "k_proj", "v_proj", "o_proj"]
        return (f"{p}model.peft.target_modules: {', '.join(mlp)} on a mixture-of-experts model: adapters on experts "
                f"are not built; adapt the attention projections only ({', '.join(attention)}: qkv_proj and "
                f"attention_dense name them)")
    return None


def document_reset(positions: bool | None, attention: bool | None, p: str) -> str | None:
    """Megatron's reset_position_ids and reset_attention_mask: documents separated inside a pretraining sequence
    (positions restart after each end-of-document token and attention stops there), built as one switch."""
    if positions is None or attention is None or positions == attention:
        return None
    return (f"{p}model.data.reset_position_ids: {positions} with reset_attention_mask: {attention}: documents are "
            f"separated in positions and attention together here; set both to {positions or attention} (or both "
            f"to false)")


def document_reset_eod(eod: int | None, tokenizer: str, p: str) -> str | None:
    if eod is not None:
        return None
    return (f"{p}model.data.reset_attention_mask: true, but the tokenizer {tokenizer} has no end-of-document token "
            f"to separate documents at; name its eos_token in the tokenizer_config.json beside it, or set "
            f"reset_position_ids and reset_attention_mask to false")


def packing_context(packing: bool, context: int, p: str) -> str | None:
    if packing and context > 1:
        return (f"{p}model.data.packing: true with a context group of {context} ranks: packed examples under "
                f"context parallelism are not built; set model.data.packing=false or context/ulysses size 1")
    return None


def stage_scheme(stage: str, lora: bool) -> str | None:
    """The peft stage trains LoRA adapters and nothing else; fine_tuning trains every weight (NeMo's split)."""
    from runtime.schema.reader import show

    if stage == "peft" and not lora:
        return ("peft.model.peft.peft_scheme: null in the peft stage, which trains LoRA adapters; set "
                "peft.model.peft.peft_scheme=lora (with lora_rank, lora_alpha, target_modules), or run "
                "stages=[fine_tuning] to train every weight")
    if stage == "fine_tuning" and lora:
        return (f"fine_tuning.model.peft.peft_scheme: {show('lora')} in the fine_tuning stage, which trains every "
                f"weight; use the peft stage for LoRA (stages=[peft] peft=<recipe>), or set "
                f"fine_tuning.model.peft.peft_scheme=null")
    return None


def fine_tuning_data(has_sft: bool, has_prefix: bool, p: str) -> str | None:
    if has_sft and has_prefix:
        return (f"{p}model.data: both data_prefix (pretraining) and train_ds (fine-tuning) are set; keep "
                f"train_ds.file_names for fine-tuning, or set model.data.train_ds=null to pretrain")
    return None


# ------------------------------------------------------------------------------------------------ alignment
def preference_beta(beta: float, key: str) -> str | None:
    if beta <= 0:
        return (f"{key}: {beta} must be > 0 (how strongly the policy is held to the reference; NxD Training's "
                f"recipes use 0.01-0.1)")
    return None


def prompt_limit(limit: int, seq_length: int | None, key: str) -> str | None:
    if limit < 1:
        return f"{key}: {limit} must be a positive number of tokens"
    if seq_length is not None and limit >= seq_length:
        return (f"{key}: {limit} leaves no room for the response in a row of seq_length {seq_length}; set it "
                f"below seq_length (half of it is usual)")
    return None


def reference_source(precompute: bool, lora: bool, p: str) -> str | None:
    """Without precomputed references, the reference is the base model with its adapters switched off: only LoRA
    has one without holding a second model."""
    if not precompute and not lora:
        return (f"{p}model_alignment_strategy.dpo.precompute_ref_log_probs: false trains every weight, so the "
                f"reference would be a second model in memory; set it to true (computed once before training) or "
                f"use LoRA (model.peft.peft_scheme=lora)")
    return None


def alignment_layout(context: int, packing: bool | None, p: str) -> str | None:
    if context > 1:
        return (f"{p}model.context_parallel_size: a context group of {context} ranks in the alignment stage: a "
                f"pair's log-probabilities are summed over whole sequences; set context_parallel_size and "
                f"ulysses_parallel_size to 1")
    if packing:
        return (f"{p}model.data.packing: true in the alignment stage: each pair is its own two rows (chosen and "
                f"rejected side by side); remove model.data.packing or set it to false")
    return None


def alignment_stage(stage: str, strategies: tuple[str, ...]) -> str | None:
    """model_alignment_strategy.dpo/orpo belong to the alignment stage, which reads them."""
    if strategies and stage != "alignment":
        return (f"{stage}.model_alignment_strategy.{strategies[0]}: preference alignment runs in the alignment "
                f"stage; use stages=[alignment] alignment=<recipe>, or remove model_alignment_strategy.{strategies[0]}")
    return None


# ------------------------------------------------------------------------------------------------ reward model
def reward_layout(context: int, packing: bool | None, p: str) -> str | None:
    """The rlhf_rm stage scores each row at one position (its response's last token): no context parallelism."""
    if context > 1:
        return (f"{p}model.context_parallel_size: a context group of {context} ranks in the rlhf_rm stage: a reward "
                f"model scores each row at its response's last token, which one rank holds; set "
                f"context_parallel_size and ulysses_parallel_size to 1")
    if packing:
        return (f"{p}model.data.packing: true in the rlhf_rm stage: each pair is its own two rows (chosen and "
                f"rejected side by side); remove model.data.packing or set it to false")
    return None


def reward_stage(stage: str, present: bool) -> str | None:
    """The reward_model section belongs to the rlhf_rm stage, which reads it."""
    if present and stage != "rlhf_rm":
        return (f"{stage}.reward_model: a reward model trains in the rlhf_rm stage; use stages=[rlhf_rm] "
                f"rlhf_rm=<recipe>, or remove {stage}.reward_model")
    return None

"""The mixture-of-experts rules: model.moe's block, routing and groups, the selection bias's update, experts
over expert parallelism, and dropless batches on XLA. Rules as runtime/schema/rules.py describes them; callers use
them as rules.<name>."""
from __future__ import annotations

import math

from runtime.schema.families import ARCHITECTURES, known_architecture


# ---------------------------------------------------------------------------------------------------------- moe
def moe(architecture: str, num_experts: int, top_k: int, frequency: int, num_layers: int,
        capacity_factor: float | None, activation: str, p: str, *, layers: tuple[int, ...] | None = None,
        ffn: int | None = None, ffn_dropout: float | None = None, groups: tuple[int, int] = (1, 1)) -> list[str]:
    """model.moe: a sparse MoE block needs the Llama block (SwiGLU experts), top_k of the experts, a layer pattern
    that leaves at least one MoE layer, and a positive capacity factor (or dropless); model.ffn_dropout is the dense
    MLP's, which the experts do not have. `groups`: (moe.groups, moe.top_groups), group-limited routing's groups of
    at least 2 experts (each ranked by its two best), top_groups of them holding at least top_k experts."""
    key = f"{p}model.moe"
    problems = []
    network = known_architecture(architecture)
    if network is not None and not network.moe:
        problems.append(f"{key}: MoE layers are Mixtral's (SwiGLU experts in the Llama block); set "
                        f"{p}model.architecture={' or '.join(a.name for a in ARCHITECTURES.values() if a.moe)}")
    if num_experts < 2:
        problems.append(f"{key}.num_experts: {num_experts} must be at least 2 (1 expert is the dense MLP)")
    elif not 1 <= top_k <= num_experts:
        problems.append(f"{key}.top_k: {top_k} must be from 1 to num_experts ({num_experts})")
    if layers is not None:
        if not layers or any(not 0 <= i < num_layers for i in layers) or len(set(layers)) != len(layers):
            problems.append(f"{key}.layers: {list(layers)} must list distinct layer indexes from 0 to "
                            f"{num_layers - 1}, at least one; or drop it to use {key}.frequency")
    elif not 1 <= frequency <= num_layers:
        problems.append(f"{key}.frequency: {frequency} must be from 1 (every layer) to num_layers ({num_layers})")
    if ffn is not None and ffn <= 0:
        problems.append(f"{key}.ffn_hidden_size: {ffn} must be a positive integer; or null for model.ffn_hidden_size")
    if capacity_factor is not None and not (math.isfinite(capacity_factor) and capacity_factor > 0):
        problems.append(f"{key}.capacity_factor: {capacity_factor} must be a positive number; or set "
                        f"{key}.dropless=true")
    if activation not in ("softmax", "sigmoid"):
        problems.append(f"{key}.router_activation: {activation!r} is not one of softmax, sigmoid")
    count, top = groups
    if count > 1 and (num_experts % count or num_experts // count < 2):
        problems.append(f"{key}.groups: {count} must divide num_experts ({num_experts}) into groups of at least 2 "
                        "experts (a group is ranked by its two best scores)")
    elif not 1 <= top <= count:
        problems.append(f"{key}.top_groups: {top} must be from 1 to groups ({count})")
    elif top_k > top * (num_experts // count):
        problems.append(f"{key}.top_k: {top_k} is more than the {top * (num_experts // count)} experts of "
                        f"top_groups ({top}) groups; raise top_groups")
    if ffn_dropout:
        problems.append(f"{p}model.ffn_dropout: {ffn_dropout} with {key}: dropout inside the experts is not built; "
                        f"set it to 0.0")
    return problems


def bias_update(rate: float, score_bias: bool, p: str, *, lora: bool = False) -> str | None:
    """model.moe.router_bias_update_rate moves the expert selection bias (DeepSeek-V3's aux-loss-free balancing):
    it needs one (model.moe.score_bias), and one that trains (LoRA keeps the base model, the bias with it, frozen)."""
    key = f"{p}model.moe.router_bias_update_rate"
    if not math.isfinite(rate) or rate < 0:
        return f"{key}: {rate} must be a number >= 0 (0.0 keeps the selection bias as loaded)"
    if rate and not score_bias:
        return (f"{key}: {rate} updates the expert selection bias, which needs {p}model.moe.score_bias=true "
                f"(DeepSeek-V3's router); set score_bias=true or router_bias_update_rate=0.0")
    if rate and lora:
        return (f"{key}: {rate} with LoRA: the base model, its selection bias with it, stays frozen; set "
                f"router_bias_update_rate=0.0 (or fine-tune fully)")
    return None


def expert_layout(num_experts: int | None, ep: int, dp: int, p: str) -> str | None:
    """model.expert_model_parallel_size shards the experts over part of data parallelism (Megatron's and NxD
    Training's layout): it must divide both the data-parallel size and the number of experts."""
    if ep == 1:
        return None
    if num_experts is None:
        return f"{p}model.expert_model_parallel_size: {ep} needs MoE layers (set {p}model.moe.num_experts) or 1"
    return ep_divides_dp(ep, dp, p) or ep_divides_experts(ep, num_experts, p)


def ep_divides_dp(ep: int, dp: int, p: str) -> str | None:
    if ep >= 1 and dp % ep == 0:
        return None
    return (f"{p}model.expert_model_parallel_size: {ep} must divide the data-parallel size {dp} (world / "
            f"(tensor_model_parallel_size x pipeline_model_parallel_size)); use a divisor of {dp}")


def ep_divides_experts(ep: int, num_experts: int, p: str) -> str | None:
    if num_experts % ep == 0:
        return None
    return (f"{p}model.expert_model_parallel_size: {ep} must divide {p}model.moe.num_experts ({num_experts}); "
            f"use a divisor of {num_experts}")


def dropless_on_xla(capacity_factor: float | None, accelerator: str, p: str) -> str | None:
    """Dropless expert batches are as wide as the busiest expert's count, a shape that follows the routing: XLA
    compiles a graph for each new one (minutes each with the Neuron compiler). A capacity fixes every shape."""
    if capacity_factor is None and accelerator == "neuron":
        return (f"{p}model.moe.dropless: expert batch shapes follow the routing, and the Neuron compiler compiles "
                f"each new one; set {p}model.moe.dropless=false with a capacity_factor (NxD Training's Trn1 recipe: "
                f"2.0) for fixed shapes")
    return None

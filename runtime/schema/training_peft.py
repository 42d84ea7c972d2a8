"""model.peft in a training stage config: LoRA's keys (NxD Training's), the stages that may set them, and the
fine-tuning rules across sections (packing against context parallelism, LoRA against MoE)."""
from __future__ import annotations

from runtime.schema import choices as C
from runtime.schema import rules
from runtime.schema.model import LatentAttention, ModelConfig
from runtime.schema.reader import Report, Section
from runtime.schema.training_config import LoraConfig, ParallelConfig, SFTDataConfig


def read_peft(model: Section, shape: dict, p: str) -> LoraConfig | None:
    """model.peft, read as parse_lora reads it, and refused in a stage that does not train adapters."""
    report = model.report
    lora = parse_lora(model, shape.get("architecture"), p, shape.get("latent_attention"))
    peft = model.data.get("peft")
    scheme = peft.get("peft_scheme") if isinstance(peft, dict) else None
    if scheme in C.PEFT_SCHEMES and (problem := rules.stage_scheme(p.rstrip("."), C.PEFT_SCHEMES.canonical(scheme)
                                                                   == "lora")):
        # LoRA keys in the wrong stage: the stage is the mistake, not the keys' values.
        report.errors[:] = [e for e in report.errors if not e.startswith(f"{p}model.peft.")]
        report.error(problem)
    return lora


def parse_lora(model: Section, architecture: str | None, p: str, latent: LatentAttention | None = None
               ) -> LoraConfig | None:
    """model.peft (NxD Training's keys): peft_scheme lora, lora_rank, lora_alpha, lora_dropout, target_modules.
    `latent` (model.latent_attention) decides the names on multi-head latent attention, where a group's q, k and v
    are its query and key-value projections (choices.LATENT_LORA_PARTS)."""
    if model.raw("peft", None) is None:
        return None
    peft = model.section("peft")
    if peft.choice("peft_scheme", C.PEFT_SCHEMES, None) is None:
        for key in ("lora_rank", "lora_alpha", "lora_dropout", "target_modules"):
            peft.raw(key, None)
        return None
    rank = peft.int("lora_rank", 16)
    alpha = peft.float("lora_alpha", 32.0)
    dropout = peft.float("lora_dropout", 0.0)
    targets = peft.strings("target_modules")
    if None in (rank, alpha, dropout, targets):
        return None
    problems = [rules.lora_rank(rank, p), rules.lora_alpha(alpha, p), rules.lora_dropout(dropout, p),
                rules.lora_targets(targets, architecture, p, latent)]
    for problem in problems:
        model.report.error(problem)
    if any(problems):
        return None
    parts = C.LATENT_LORA_PARTS if latent is not None else {}
    modules = rules.lora_modules(architecture, latent)
    expanded = []
    for name in targets:
        if name not in C.LORA_GROUPS:
            expanded.append(name)
            continue
        # A group keeps the names this model has (GPT's MLP input is up_proj; latent attention's by q_lora_rank).
        members = [m for member in C.LORA_GROUPS[name] for m in parts.get(member, (member,))]
        expanded += [m for m in members if m in modules]
    return LoraConfig(rank=rank, alpha=alpha, dropout=dropout, target_modules=tuple(dict.fromkeys(expanded)))


def saved_lora(model: dict, cfg: ModelConfig | None = None) -> tuple[LoraConfig | None, Report]:
    """A saved training config's LoRA (its `model:` section), with its targets as the model `cfg` names them when
    given (the saved YAML may leave the architecture to the config.json of its restore_from_path)."""
    report = Report()
    architecture, latent = (model.get("architecture"), None) if cfg is None else (cfg.architecture,
                                                                                  cfg.latent_attention)
    return parse_lora(Section(model, "model", report), architecture, "", latent), report


def fine_tuning_rules(report: Report, p: str, parallel: ParallelConfig, shape: dict, sft: SFTDataConfig | None,
                      lora: LoraConfig | None) -> None:
    if sft is not None:
        report.error(rules.packing_context(sft.packing, parallel.context, p))
    if lora is not None:
        moe = shape.get("moe")
        report.error(rules.lora_moe(moe.num_experts if moe is not None else None, lora.target_modules, p,
                                    shape.get("latent_attention")))
        if moe is not None:
            report.error(rules.bias_update(moe.router_bias_update_rate, moe.score_bias, p, lora=True))

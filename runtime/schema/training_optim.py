"""model.optim in a training stage config: the optimizer and its learning-rate schedule (optim.sched), and their
rules against each other and the parallel layout."""
from __future__ import annotations

from runtime.schema import choices as C
from runtime.schema import rules
from runtime.schema.reader import Report, Section
from runtime.schema.training_config import OptimConfig, ParallelConfig, SchedConfig


def read_optim(model: Section, max_steps: int | None, p: str) -> OptimConfig | None:
    optim = model.section("optim")
    betas = optim.raw("betas", [0.9, 0.999])
    model.report.error(rules.betas(betas, p))
    sched = optim.section("sched")
    values = dict(name=optim.choice("name", C.OPTIMIZERS, "adamw"), lr=optim.float("lr"),
                  weight_decay=optim.float("weight_decay", 0.0, minimum=0.0), eps=optim.float("eps", 1e-8, minimum=0.0),
                  momentum=optim.float("momentum", 0.0, minimum=0.0),
                  dampening=optim.float("dampening", 0.0, minimum=0.0),
                  nesterov=optim.bool("nesterov", False))
    sched_values = dict(
        name=sched.choice("name", C.SCHEDULES, "Constant"),
        warmup_steps=sched.int("warmup_steps", 0, minimum=0),
        constant_steps=sched.int("constant_steps", 0, minimum=0),
        min_lr=sched.float("min_lr", 0.0, minimum=0.0),
        max_steps=sched.int("max_steps", max_steps, minimum=1) if max_steps is not None else None,
    )
    if any(v is None for v in (*values.values(), *sched_values.values())) or model.report.errors:
        return None
    return OptimConfig(betas=(float(betas[0]), float(betas[1])), sched=SchedConfig(**sched_values), **values)


def optim_rules(report: Report, p: str, optim: OptimConfig, parallel: ParallelConfig) -> None:
    """The learning rate, the optimizer's options and layout, and the schedule against trainer.max_steps."""
    sched = optim.sched
    report.error(rules.learning_rate(optim.lr, p))
    report.error(rules.optimizer_options(optim.name, optim.momentum, optim.dampening, optim.nesterov, p))
    report.error(rules.optimizer_layout(optim.name, parallel.zero1, parallel.tp, parallel.ep, p))
    report.error(rules.min_lr(sched.min_lr, optim.lr, sched.name, p))
    report.error(rules.schedule_fits(sched.warmup_steps, sched.constant_steps, sched.max_steps, p))
    if holds := rules.schedule_holds(sched.warmup_steps, sched.constant_steps, sched.max_steps, p):
        report.warn(holds)

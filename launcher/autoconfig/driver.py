# An autoconfig search from start to end: compose the search and its base recipe, size the model, rank the
# layout grid, launch the best-ranked candidates as short runs, measure them, and write the results.
from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from launcher.autoconfig import report, runner, search, sizing
from launcher.compose import compose, resolve
from launcher.errors import UserError
from launcher.estimator.hardware import detect, hardware_for
from launcher.estimator.shapes import padded_vocab, vocab_size_for

DEFAULT_SEARCH = "gpt3/tiny"
TRAIN_SETTINGS = ("num_nodes", "devices_per_node", "device", "days", "tokens_in_billions", "model_size_in_b",
                  "assumed_mfu", "seq_length", "global_batch_size", "vocab_size", "max_steps_per_run",
                  "max_minutes_per_run", "limit_search_runs", "top_n")


def override(key: str, value: Any) -> str:
    """A Hydra override for a Python value."""
    def text(v: Any) -> str:
        if v is None:
            return "null"
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (list, tuple)):
            return "[" + ",".join(text(x) for x in v) + "]"
        return repr(v) if isinstance(v, float) else str(v)
    return f"{key}={text(value)}"


def split_overrides(overrides: list[str]) -> tuple[str, list[str], list[str]]:
    """(search config choice, search_config.* overrides, the launch's own overrides)."""
    choice, own, launch_overrides = DEFAULT_SEARCH, [], []
    for item in overrides:
        key = item.lstrip("+~").split("=", 1)[0]
        if key == "search_config":
            choice = item.split("=", 1)[1]
        elif key.startswith("search_config."):
            own.append(item)
        elif key == "training":
            raise UserError(f"{item}: the search chooses the training recipe; set search_config.base_recipe=... "
                            "(training.* overrides are passed on to every candidate)")
        else:
            launch_overrides.append(item)
    return choice, own, launch_overrides


def _positive(settings: dict[str, Any], key: str, *, number: type = int, optional: bool = False) -> Any:
    value = settings.get(key)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0 or \
            (number is int and value != int(value)):
        kind = "a positive integer" if number is int else "a positive number"
        raise UserError(f"search_config.train_settings.{key}: {value!r} must be {kind}"
                        + (" or null" if optional else ""))
    return number(value)


def _compose_search(choice: str, own: list[str], launch_overrides: list[str]) -> dict[str, Any]:
    from launcher.paths import conf_dir

    if not (conf_dir() / "search_config" / f"{choice}.yaml").exists():
        known = sorted(str(p.relative_to(conf_dir() / "search_config").with_suffix(""))
                       for p in (conf_dir() / "search_config").rglob("*.yaml"))
        raise UserError(f"search_config={choice}: no such choice; valid choices: {', '.join(known)}")
    return resolve(compose([f"+search_config={choice}", *own, *launch_overrides]))["search_config"]


def run(overrides: list[str], *, dry_run: bool, produced_by: str, console) -> int:
    from rich.markup import escape

    choice, own, launch_overrides = split_overrides(overrides)
    settings = _compose_search(choice, own, launch_overrides)
    train = settings["train_settings"]
    unknown = sorted(set(train) - set(TRAIN_SETTINGS))
    if unknown:
        raise UserError(f"search_config.train_settings.{unknown[0]}: unknown key; valid: {', '.join(TRAIN_SETTINGS)}")
    name, recipe, results_dir = str(settings["name"]), str(settings["base_recipe"]), Path(settings["results_dir"])
    recipe_overrides = [f"training={recipe}", *launch_overrides]
    composed = resolve(compose(recipe_overrides))
    base = composed["training"]

    nodes = _positive(train, "num_nodes", optional=True) or int(base["trainer"]["num_nodes"])
    devices = _positive(train, "devices_per_node", optional=True) or int(base["trainer"]["devices"])
    seq = _positive(train, "seq_length", optional=True) or int(base["model"]["encoder_seq_length"])
    gbs = _positive(train, "global_batch_size", optional=True) or int(base["model"]["global_batch_size"])
    billions = _positive(train, "tokens_in_billions", number=float, optional=True)
    tokens = billions * 1e9 if billions else float(base["trainer"]["max_steps"]) * gbs * seq
    days = _positive(train, "days", number=float)
    size = _positive(train, "model_size_in_b", number=float, optional=True)
    max_steps, minutes = _positive(train, "max_steps_per_run"), _positive(train, "max_minutes_per_run")
    limit, top_n = _positive(train, "limit_search_runs"), _positive(train, "top_n")

    vocab = _positive(train, "vocab_size", optional=True)
    try:
        vocab = vocab_size_for(base, vocab)
    except UserError:
        raise UserError(f"training.model.tokenizer.model: {base['model']['tokenizer']['model']} does not exist; "
                        "prepare the data first (e.g. nxdt-launch stages=[data_preparation]) or set "
                        "search_config.train_settings.vocab_size") from None
    architecture = str(base["model"]["architecture"])
    divisible = int(base["model"].get("make_vocab_size_divisible_by") or 128)
    neuron = ((composed.get("cluster") or {}).get("neuron") or {}).get("hardware")
    accelerator = str(base["trainer"]["accelerator"])
    device = train.get("device") or (neuron if accelerator == "neuron" and neuron else None) \
        or detect(accelerator, devices)
    hardware = hardware_for(device, devices)
    mfu = float(train.get("assumed_mfu") or hardware.default_mfu)
    advice = sizing.recommend_model_size(architecture=architecture, vocab=padded_vocab(vocab, divisible),
                                         seq_length=seq, tokens=tokens, days=days, devices=nodes * devices,
                                         hardware=hardware, mfu=mfu, model_size=size * 1e9 if size else None)
    spec = advice.spec
    console.print(
        f"search {escape(name)}: {nodes} × {devices} {escape(hardware.description)}, {tokens:,.0f} tokens in "
        f"{days:g} days at MFU {mfu:.0%} = {advice.budget_flops:.3g} FLOPs; 6·N·T gives N = "
        f"{advice.six_n_t_parameters:,.0f}. Model: {spec.num_layers} layers, hidden {spec.hidden_size}, "
        f"{spec.num_attention_heads} heads ({advice.parameters:,} parameters, {advice.days:.3g} days)"
        + ("" if advice.fits_budget else " [yellow]: more than the budget[/]"),
        soft_wrap=True)

    base_settings = sizing.base_settings(spec, architecture=architecture, seq_length=seq, global_batch_size=gbs,
                                         tokens=tokens, num_nodes=nodes, devices_per_node=devices)
    base_overrides = [override(f"training.{key}", value) for key, value in base_settings.items()]
    base_training = resolve(compose([*recipe_overrides, *base_overrides]))["training"]
    ranked = search.rank(base_training, search.grid(settings["search"], nodes=nodes, devices_per_node=devices,
                                                    num_layers=spec.num_layers,
                                                    zero1_default=bool(base_training["model"].get("zero1"))),
                         device=device, mfu=mfu, vocab_size=vocab)
    launchable = [r for r in ranked if r.rejected is None]
    console.print(report.candidates_table(ranked, max(limit, top_n) + 3,
                                          f"{len(ranked)} layouts, {len(launchable)} valid and within memory; "
                                          f"the first {min(limit, len(launchable))} are launched"))
    if not launchable:
        raise UserError(f"search_config.search: none of the {len(ranked)} layouts is valid and fits the device; "
                        "widen the grid (e.g. search_config.search.tensor_parallel_sizes=auto) or add nodes")
    if dry_run:
        return 0

    runs_dir = results_dir / "runs"
    short_run = [override("training.trainer.max_steps", max_steps), "training.trainer.val_check_interval=0",
                 "training.trainer.log_every_n_steps=1", "training.model.optim.sched.warmup_steps=0",
                 "training.model.optim.sched.constant_steps=0", f"training.run.time_limit={minutes}",
                 "training.exp_manager.create_tensorboard_logger=false",
                 "training.exp_manager.resume_if_exists=false", "stages=[training]", f"base_results_dir={runs_dir}"]
    trials = []
    for index, item in enumerate(launchable[:limit], start=1):
        run_name = f"{name}_{index:02d}_{item.candidate.tag}"
        layout = [override(f"training.{key}", value) for key, value in item.candidate.settings().items()]
        trials.append(runner.Trial(item, run_name, [*recipe_overrides, *base_overrides, *layout, *short_run,
                                                    f"run_name={run_name}", f"training.run.name={run_name}"]))
    runner.submit(trials, produced_by=produced_by)
    executor = trials[0].plan.executor
    console.print(f"launched {len(trials)} candidate runs ({executor} executor) under {escape(str(runs_dir))}")
    if executor == "slurm":
        runner.wait_slurm(trials, deadline_s=len(trials) * (minutes + 5) * 60)
    else:
        for trial in trials:
            runner.run_local(trial, timeout_s=minutes * 60)
    measurements = [runner.measure(trial) for trial in trials]

    csv_path = report.write_csv(results_dir / "results.csv", measurements)
    console.print(report.results_table(measurements, top_n, f"measured ({max_steps} steps each, medians after "
                                                            "step 1), fastest first"))
    console.print(f"results: {escape(str(csv_path))}")
    good = report.ordered([m for m in measurements if m.ok])
    if not good:
        console.print("[red]no candidate finished[/]; see the reasons above and the runs' logs")
        return 1
    best = good[0]
    conf_root = results_dir / "conf"
    best_path = write_best_config(best, name=name, conf_root=conf_root, recipe_overrides=recipe_overrides,
                                  base_overrides=base_overrides, tried=len(measurements), command=produced_by)
    extra = [o for o in launch_overrides if not o.startswith(("training.", "+training.", "~training."))]
    usage = shlex.join(["nxdt-launch", f"hydra.searchpath=[file://{conf_root}]", f"training=autoconfig/{name}",
                        *extra])
    console.print(f"best config: {escape(str(best_path))}\ntrain it:    {escape(usage)}", soft_wrap=True)
    return 0


def write_best_config(best: runner.Measurement, *, name: str, conf_root: Path, recipe_overrides: list[str],
                      base_overrides: list[str], tried: int, command: str) -> Path:
    """The winner's full-run training config, composed like a launch (interpolations kept, so data_dir and
    base_results_dir still come from the launch that uses it), under <results_dir>/conf/training/autoconfig/."""
    from omegaconf import OmegaConf

    layout = [override(f"training.{key}", value) for key, value in best.trial.ranked.candidate.settings().items()]
    cfg = compose([*recipe_overrides, *base_overrides, *layout, f"training.run.name={name}"])
    text = report.best_config_text(OmegaConf.to_yaml(cfg.training), name=name, best=best, tried=tried,
                                   conf_root=conf_root, command=command)
    path = conf_root / "training" / "autoconfig" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


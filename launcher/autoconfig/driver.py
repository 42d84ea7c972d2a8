# An autoconfig search from start to end: compose the search and its base recipe, size the model, rank the
# layout grid, launch the best-ranked candidates as short runs, measure them, and write the results.
from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path
from typing import Any

from launcher.autoconfig import report, runner, search, sizing
from launcher.compose import compose, resolve
from launcher.config import LaunchConfig, parse
from launcher.errors import UserError, print_not_checked
from launcher.estimator.hardware import DEVICE_NAMES, Hardware, detect, hardware_for
from launcher.estimator.shapes import padded_vocab, vocab_for
from launcher.launch import choose_executor
from runtime.schema.data_preparation import UserError as PreparationError
from runtime.schema.data_preparation import parse_config as parse_preparation
from runtime.schema.data_preparation import trained_vocab_size
from runtime.schema.training import is_remote, model_shape_keys, parse_sizing, parse_trainer, tokenizer_vocab
from runtime.schema.training_config import SizingConfig

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


def layout_overrides(candidate: search.Candidate) -> list[str]:
    """A candidate's settings as launch overrides; `++` (add or set) as not every recipe names model.zero_stage
    or model.data_parallel_shard_degree."""
    added = ("model.zero_stage", "model.data_parallel_shard_degree")
    return [override(f"{'++' if key in added else ''}training.{key}", value)
            for key, value in candidate.settings().items()]


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


def _compose_search(choice: str, own: list[str], launch_overrides: list[str]) -> dict[str, Any]:
    from launcher.paths import conf_dir

    if not (conf_dir() / "search_config" / f"{choice}.yaml").exists():
        known = sorted(str(p.relative_to(conf_dir() / "search_config").with_suffix(""))
                       for p in (conf_dir() / "search_config").rglob("*.yaml"))
        raise UserError(f"search_config={choice}: no such choice; valid choices: {', '.join(known)}")
    return resolve(compose([f"+search_config={choice}", *own, *launch_overrides]))["search_config"]


@dataclasses.dataclass(frozen=True)
class Search:
    """search_config as composed (conf/search_config/): the search's own settings, not a launch's."""
    name: str
    base_recipe: str
    results_dir: Path
    train_settings: dict[str, Any]   # read_budget checks them
    grid: dict[str, Any]             # search_config.search: the layouts to try (search.grid)


def read_search(settings: dict[str, Any]) -> Search:
    return Search(name=str(settings["name"]), base_recipe=str(settings["base_recipe"]),
                  results_dir=Path(settings["results_dir"]), train_settings=settings["train_settings"],
                  grid=settings["search"])


@dataclasses.dataclass(frozen=True)
class Budget:
    """train_settings, with every null filled from the base recipe."""
    nodes: int
    devices: int
    seq_length: int
    global_batch_size: int
    tokens: float
    days: float
    model_size: float | None     # parameters, when the search names one
    vocab: int                   # the tokenizer's, unpadded
    device: str
    hardware: Hardware
    mfu: float
    max_steps: int               # per trial
    minutes: int                 # per trial
    limit: int                   # trials
    top_n: int
    unchecked: tuple[str, ...] = ()   # what a dry run sized the model without (a tokenizer not made yet)
    shape: dict[str, Any] = dataclasses.field(default_factory=dict)  # the base recipe's model keys (model_shape)


def _positive(settings: dict[str, Any], key: str, *, number: type = int, optional: bool = False) -> Any:
    """train_settings.KEY by the schema's reader (runtime/schema/reader.py): its rules for an integer or a finite
    number, the same as every stage config's."""
    from runtime.schema.reader import Report, Section

    if optional and settings.get(key) is None:
        return None
    report = Report()
    section = Section(settings, "search_config.train_settings", report)
    value = section.int(key, minimum=1) if number is int else section.float(key, above=0.0)
    if value is None:
        kind = "a positive integer" if number is int else "a positive number"
        problem = report.errors[0]
        raise UserError(problem + ("" if "must be" in problem else f"; give {kind}") + (" (or null)" if optional else ""))
    return value


def vocabulary(training: SizingConfig, preparation: Any, override: int | None, *,
               dry_run: bool) -> tuple[int, list[str]]:
    """The unpadded vocabulary the model is sized for, and what a dry run could not check to find it:
    train_settings.vocab_size, else model_config's, the tokenizer file's, or a known tokenizer's named in its path
    (vocab_for). A tokenizer file that is not here is judged by the training schema's one rule on it: an error
    for a real search (its trials would train on it), a warning in a dry run, which sizes the model for the
    vocabulary the data_preparation config trains into that path (the demo's 4096) before it has run."""
    path = training.tokenizer_path
    unseen = bool(path) and not is_remote(path) and not Path(path).is_file()
    if override or training.model.get("model_config") is not None:
        return vocab_for(training, override), []
    try:
        vocab = vocab_for(training)
    except UserError:
        if not path:
            raise
    else:
        named = f"{path} is not on this machine; sized for the {vocab} tokens of the tokenizer its name says"
        return vocab, [f"training.model.tokenizer.model: {named}"] if unseen and dry_run else []
    _, rule = tokenizer_vocab(path, files="warn" if dry_run else "error")
    if rule.errors:
        raise UserError(*rule.errors)
    planned = None
    if isinstance(preparation, dict):
        try:
            planned = trained_vocab_size(parse_preparation(preparation), path)
        except PreparationError:
            planned = None  # a data_preparation config with mistakes makes nothing to size for
    if planned is None:
        found = rule.warnings[0] if rule.warnings else \
            f"training.model.tokenizer.model: {path} cannot be read here"
        raise UserError(f"{found}; or set search_config.train_settings.vocab_size=N to size the model without it")
    return planned, [f"training.model.tokenizer.model: {path} does not exist yet (nxdt-launch "
                     f"stages=[data_preparation] makes it); the model is sized for the {planned} tokens it will have "
                     f"(data_preparation.tokenizer.train.vocab_size)"]


def model_shape(training: SizingConfig) -> dict[str, Any]:
    """The base recipe's model keys, with those its model_config supplies (the estimator's view of the shape)."""
    try:
        return model_shape_keys(training.model)
    except ValueError as error:
        raise UserError(f"{error}; the search sizes the model by it") from None


def read_budget(train: dict[str, Any], cfg: LaunchConfig, *, dry_run: bool = False) -> Budget:
    unknown = sorted(set(train) - set(TRAIN_SETTINGS))
    if unknown:
        raise UserError(f"search_config.train_settings.{unknown[0]}: unknown key; valid: {', '.join(TRAIN_SETTINGS)}")
    base = cfg.composed_section("training")  # the schema reads it (run mapping or not)
    sizing, sizing_report = parse_sizing(base)
    nodes = _positive(train, "num_nodes", optional=True)
    numbers = {key: _positive(train, key, optional=True) for key in
               ("devices_per_node", "seq_length", "global_batch_size", "vocab_size")}
    numbers |= {key: _positive(train, key, number=float, optional=True) for key in
                ("tokens_in_billions", "model_size_in_b", "assumed_mfu")}
    numbers |= {key: _positive(train, key) for key in
                ("max_steps_per_run", "max_minutes_per_run", "limit_search_runs", "top_n")}
    days = _positive(train, "days", number=float)
    if (numbers["assumed_mfu"] or 0) > 1:
        raise UserError(f"search_config.train_settings.assumed_mfu: {numbers['assumed_mfu']} must be at most 1")
    device = train.get("device")
    if device is not None and device not in DEVICE_NAMES:
        raise UserError(f"search_config.train_settings.device: {device!r} is not one of {', '.join(DEVICE_NAMES)}")
    vocab, unchecked = vocabulary(sizing, cfg.composed_section("data_preparation"), numbers["vocab_size"],
                                  dry_run=dry_run)

    trainer, report = parse_trainer(base)  # the schema's reading, as the launch sizes the job by
    if trainer is None:
        raise UserError(*report.errors)
    devices = numbers["devices_per_node"] or trainer.devices
    neuron = cfg.cluster.neuron_hardware
    if device is None:
        device = neuron if trainer.accelerator == "neuron" and neuron else detect(trainer.accelerator, devices)
    hardware = hardware_for(device, devices, cfg.cluster.node_memory_bytes)
    shape = model_shape(sizing)
    seq = numbers["seq_length"] or int(shape["encoder_seq_length"])
    gbs = numbers["global_batch_size"] or sizing.global_batch_size
    if gbs is None:
        raise UserError(*sizing_report.errors)
    billions, size = numbers["tokens_in_billions"], numbers["model_size_in_b"]
    return Budget(
        nodes=nodes or trainer.num_nodes, devices=devices, seq_length=seq,
        global_batch_size=gbs, tokens=billions * 1e9 if billions else float(trainer.max_steps) * gbs * seq,
        days=days, model_size=size * 1e9 if size else None, vocab=vocab, device=device, hardware=hardware,
        mfu=numbers["assumed_mfu"] or hardware.default_mfu, max_steps=numbers["max_steps_per_run"],
        minutes=numbers["max_minutes_per_run"], limit=numbers["limit_search_runs"], top_n=numbers["top_n"],
        unchecked=tuple(unchecked), shape=shape,
    )


@dataclasses.dataclass(frozen=True)
class Ranking:
    """A search up to its trials: what it launches each trial with, and the layouts ranked."""
    settings: Search
    launch_overrides: list[str]      # the user's, passed to every trial
    recipe_overrides: list[str]      # the base recipe and the launch overrides
    base_overrides: list[str]        # the sized model and the budget's schedule, under training.
    budget: Budget
    ranked: list[search.Ranked]      # launchable first, fastest estimate first (search.rank)
    dry_run: bool

    @property
    def launchable(self) -> list[search.Ranked]:
        return [r for r in self.ranked if r.rejected is None]

    def trial_overrides(self, item: search.Ranked, index: int) -> tuple[str, list[str]]:
        """(run name, launch overrides) of the `index`th trial, the ranked layout `item` as a short run."""
        name, budget = self.settings.name, self.budget
        run_name = f"{name}_{index:02d}_{item.candidate.tag}"
        short_run = [override("training.trainer.max_steps", budget.max_steps), "training.trainer.val_check_interval=0",
                     "training.trainer.log_every_n_steps=1", "training.model.optim.sched.warmup_steps=0",
                     "training.model.optim.sched.constant_steps=0", f"training.run.time_limit={budget.minutes}",
                     "training.exp_manager.create_tensorboard_logger=false",
                     "training.exp_manager.resume_if_exists=false", "stages=[training]",
                     f"base_results_dir={self.settings.results_dir / 'runs'}"]
        layout = layout_overrides(item.candidate)
        return run_name, [*self.recipe_overrides, *self.base_overrides, *layout, *short_run, f"run_name={run_name}",
                          f"training.run.name={run_name}"]


def rank(overrides: list[str], *, dry_run: bool, console) -> Ranking:
    """Compose the search, size the model, and rank the layout grid (printing both); launch nothing."""
    from rich.markup import escape

    choice, own, launch_overrides = split_overrides(overrides)
    settings = read_search(_compose_search(choice, own, launch_overrides))
    recipe_overrides = [f"training={settings.base_recipe}", *launch_overrides]
    cfg = parse(resolve(compose(recipe_overrides)))
    dry_run = dry_run or cfg.dry_run  # dry_run=true, as for a launch
    budget = read_budget(settings.train_settings, cfg, dry_run=dry_run)
    print_not_checked(budget.unchecked)
    shape = budget.shape  # read_budget's reading of the base recipe
    architecture = str(shape["architecture"])
    divisible = int(shape.get("make_vocab_size_divisible_by") or 128)

    # 1. The model the budget trains, and the full-run config for it.
    advice = sizing.recommend_model_size(
        architecture=architecture, vocab=padded_vocab(budget.vocab, divisible), seq_length=budget.seq_length,
        tokens=budget.tokens, days=budget.days, devices=budget.nodes * budget.devices, hardware=budget.hardware,
        mfu=budget.mfu, model_size=budget.model_size)
    spec = advice.spec
    console.print(
        f"search {escape(settings.name)}: {budget.nodes} × {budget.devices} {escape(budget.hardware.description)}, "
        f"{budget.tokens:,.0f} tokens in {budget.days:g} days at MFU {budget.mfu:.0%} = {advice.budget_flops:.3g} "
        f"FLOPs; 6·N·T gives N = {advice.six_n_t_parameters:,.0f}. Model: {spec.num_layers} layers, hidden "
        f"{spec.hidden_size}, {spec.num_attention_heads} heads ({advice.parameters:,} parameters, "
        f"{advice.days:.3g} days)" + ("" if advice.fits_budget else " [yellow]: more than the budget[/]"),
        soft_wrap=True)
    base_overrides = [override(f"training.{key}", value) for key, value in sizing.base_settings(
        spec, architecture=architecture, seq_length=budget.seq_length, global_batch_size=budget.global_batch_size,
        tokens=budget.tokens, num_nodes=budget.nodes, devices_per_node=budget.devices).items()]
    base_training = parse(resolve(compose([*recipe_overrides, *base_overrides]))).composed_section("training")
    base_parallel = parse_sizing(base_training)[0].parallel

    # 2. The layouts, filtered and ranked by the estimator and by the launch's own memory check: the trials launch
    # as the search's own launch would (its cluster, and its executor: locally, this machine is the node).
    candidates = search.grid(settings.grid, nodes=budget.nodes, devices_per_node=budget.devices,
                             num_layers=spec.num_layers, zero_stage_default=base_parallel.stage if base_parallel else 0,
                             seq_length=budget.seq_length)
    executor, _ = choose_executor(str(cfg.cluster_type))
    ranked = search.rank(base_training, candidates, device=budget.device, mfu=budget.mfu, vocab_size=budget.vocab,
                         cluster=cfg.cluster, local=executor == "local")
    ranking = Ranking(settings, launch_overrides, recipe_overrides, base_overrides, budget, ranked, dry_run)
    launchable = ranking.launchable
    console.print(report.candidates_table(ranked, max(budget.limit, budget.top_n) + 3,
                                          f"{len(ranked)} layouts, {len(launchable)} valid and within memory; "
                                          f"the first {min(budget.limit, len(launchable))} are launched"))
    if not launchable:
        raise UserError(f"search_config.search: none of the {len(ranked)} layouts is valid and fits the device and "
                        "the node's host memory; widen the grid (e.g. search_config.search.tensor_parallel_sizes="
                        "auto), add nodes, or set cluster.node_memory_gib if the nodes have more host memory")
    return ranking


def run(overrides: list[str], *, dry_run: bool, produced_by: str, console) -> int:
    from rich.markup import escape

    ranking = rank(overrides, dry_run=dry_run, console=console)
    if ranking.dry_run:
        return 0
    name, results_dir, budget = ranking.settings.name, ranking.settings.results_dir, ranking.budget

    # 3. Short runs of the best-ranked layouts, through the launcher's executors.
    trials = [runner.Trial(item, *ranking.trial_overrides(item, index))
              for index, item in enumerate(ranking.launchable[:budget.limit], start=1)]
    runner.submit(trials, produced_by=produced_by)
    executor = trials[0].plan.executor
    console.print(f"launched {len(trials)} candidate runs ({executor} executor) under "
                  f"{escape(str(results_dir / 'runs'))}")
    if executor == "slurm":
        runner.wait_slurm(trials, deadline_s=len(trials) * (budget.minutes + 5) * 60)
    else:
        for trial in trials:
            runner.run_local(trial, timeout_s=budget.minutes * 60)
    measurements = [runner.measure(trial) for trial in trials]

    # 4. The CSV, the table, and the fastest layout as a training config.
    csv_path = report.write_csv(results_dir / "results.csv", measurements)
    console.print(report.results_table(measurements, budget.top_n, f"measured ({budget.max_steps} steps each, "
                                                                   "medians after step 1), fastest first"))
    console.print(f"results: {escape(str(csv_path))}")
    good = report.ordered([m for m in measurements if m.ok])
    if not good:
        console.print("[red]no candidate finished[/]; see the reasons above and the runs' logs")
        return 1
    conf_root = results_dir / "conf"
    best_path = write_best_config(good[0], name=name, conf_root=conf_root, recipe_overrides=ranking.recipe_overrides,
                                  base_overrides=ranking.base_overrides, tried=len(measurements), command=produced_by)
    # The launch overrides the search ran with, less the training ones the config now holds.
    extra = [o for o in ranking.launch_overrides if not o.lstrip("+~").startswith(("training.", "stages="))]
    usage = shlex.join(["nxdt-launch", f"hydra.searchpath=[file://{conf_root}]", f"training=autoconfig/{name}",
                        "stages=[training]", *extra])
    console.print(f"best config: {escape(str(best_path))}\ntrain it:    {escape(usage)}", soft_wrap=True)
    return 0


def write_best_config(best: runner.Measurement, *, name: str, conf_root: Path, recipe_overrides: list[str],
                      base_overrides: list[str], tried: int, command: str) -> Path:
    """The winner's full-run training config, composed like a launch (interpolations kept, so data_dir and
    base_results_dir still come from the launch that uses it), under <results_dir>/conf/training/autoconfig/."""
    from omegaconf import OmegaConf

    layout = layout_overrides(best.trial.ranked.candidate)
    cfg = compose([*recipe_overrides, *base_overrides, *layout, f"training.run.name={name}"])
    text = report.best_config_text(OmegaConf.to_yaml(cfg.training), name=name, best=best, tried=tried,
                                   conf_root=conf_root, command=command)
    path = conf_root / "training" / "autoconfig" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path

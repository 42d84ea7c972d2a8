"""Host memory per rank (issue 40): each worker's peak RSS, sampled from outside, against that rank's own state.

    python benchmarks/host_memory.py --tree /tmp/hm-before --label before --out benchmarks/host_memory_before.json
    python benchmarks/host_memory.py --tree /work/main --label after --out benchmarks/host_memory_after.json
    python benchmarks/host_memory.py --markdown benchmarks/host_memory_before.json [benchmarks/host_memory_after.json]
    # issue 56, the asynchronous saves' host memory (before: a tree at the commit before it):
    python benchmarks/host_memory.py --tree /tmp/hm-before --label before --size 0.12b \
        --cases tp2_pp2_saves,tp4_pp2_saves --out benchmarks/host_memory_saves_before.json
    python benchmarks/host_memory.py --label after --size 0.12b --cases tp2_pp2_saves,tp4_pp2_saves \
        --out benchmarks/host_memory_saves_after.json
    python benchmarks/host_memory.py --label after045 --cases tp2_pp2_saves,tp4_pp2_saves \
        --out benchmarks/host_memory_saves_after_045b.json

Every case is the job the launcher renders: `nxdt-launch ... --dry-run` (the launcher of --tree) writes the stage
config and the local job script, and that script is run unchanged (`python -m runtime.torchrun --standalone ...
-m runtime.train --config <yaml>`, or `python -m runtime.convert --config <yaml>`), with --tree as the working
directory and PYTHONPATH, and OMP_NUM_THREADS=1. Every 0.1 s the script's process tree is walked (psutil) and each
worker's RSS read; a worker is a process whose environment holds RANK (its rank) and whose command line runs the
stage's module. The kernel's own high-water mark (VmHWM in /proc/<pid>/status, read at each sample) is kept too:
it catches what a 0.1 s sample misses.

The save cases (*_saves) train 6 steps with an asynchronous checkpoint every 2 (steps 2 and 4; step 6's, the last,
is synchronous) and split each rank's peak at the moment rank 0 logs step 2, right before the first save: before
the first save, and after it (issue 56: the save's host copy once stayed for the run).

A rank's own state is the bytes of its shard: parameters, gradients, two Adam moments and fp32 master weights
where the precision keeps them (own_state below). Targets: every rank's peak <= 1.25 x own state + the fixed
process overhead (the peak RSS of an idle torchrun worker that imported the trainer and joined a gloo group,
benchmarks/host_memory_idle.py); the export's peak <= 3 x its largest tensor + that overhead.

The model (--size): 0.45b, a Llama of 0.45B parameters (hidden 1536, 14 layers, 12 heads / 4 KV groups, SwiGLU
4096, vocabulary 32000: the demo tokenizer's 4096 ids padded with make_vocab_size_divisible_by=32000), or 0.12b
(hidden 768, 12 layers, SwiGLU 2048, the same heads and vocabulary: the save cases at 4 and 8 ranks next to
other work on a 24 GiB machine); fp32, sequence 128, micro batch 1, global batch = dp, 2 steps, no validation. Everything it needs (the demo corpus, a Hugging Face directory
of the model in 300 MB safetensors shards with an index, checkpoints) is made under --work.

A guard watches the machine: if available memory falls under --guard-gib, the case's process group is killed
and the case is reported as aborted (a shared machine must not meet the OOM killer).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
GIB = 1024 ** 3
MB = 1e6

MODELS = {
    "0.45b": {"hidden_size": 1536, "num_layers": 14, "num_attention_heads": 12, "num_query_groups": 4,
              "ffn_hidden_size": 4096, "make_vocab_size_divisible_by": 32000, "encoder_seq_length": 128,
              "micro_batch_size": 1},
    "0.12b": {"hidden_size": 768, "num_layers": 12, "num_attention_heads": 12, "num_query_groups": 4,
              "ffn_hidden_size": 2048, "make_vocab_size_divisible_by": 32000, "encoder_seq_length": 128,
              "micro_batch_size": 1},
}
MODEL = MODELS["0.45b"]
SAVE_STEPS, SAVE_EVERY = 6, 2  # the save cases: async saves at steps 2 and 4, the last (6) sync

# name -> (stage, tp, pp, dp, zero1, what it is); world = tp * pp * dp
CASES = {
    "one_process": ("training", 1, 1, 1, False, "one process"),
    "tp2": ("training", 2, 1, 1, False, "tp=2"),
    "pp2": ("training", 1, 2, 1, False, "pp=2"),
    "tp4_pp2": ("training", 4, 2, 1, False, "tp=4 x pp=2 (8 ranks)"),
    "dp2_zero1": ("training", 1, 1, 2, True, "dp=2, ZeRO-1"),
    "finetune_tp2": ("fine_tuning", 2, 1, 1, False, "fine-tuning, tp=2, from sharded HF safetensors"),
    "tp2_checkpoint": ("training", 2, 1, 1, False, "tp=2, checkpoint at step 2 (the export's source)"),
    "export": ("conversion", 1, 1, 1, False, "export of tp2_checkpoint's checkpoint"),
    "tp2_pp2_saves": ("training", 2, 2, 1, False, "tp=2 x pp=2, async saves at steps 2 and 4"),
    "tp4_pp2_saves": ("training", 4, 2, 1, False, "tp=4 x pp=2 (8 ranks), async saves at steps 2 and 4"),
}


# ---------------------------------------------------------------------------------------------------------------
# A rank's own state. Runs in a subprocess with --tree on the path (`host_memory.py _state CONFIG`), so the
# shapes are the tree's; the arithmetic is this:

def own_state(config_path: str, stage: str) -> dict:
    """Per rank: parameters of its shard and the bytes of its own state, from the model's full shapes (meta device,
    no memory) and the layout. TP splits every weight 1/tp except norms (replicated); a pipeline stage holds its
    layers (split_layers), plus the embedding on the first stage and the final norm and output head on the last;
    ZeRO-1 divides the optimizer's state (the moments, and master weights where kept) by dp."""
    from runtime.config import load_training_config
    from runtime.models import meta_model
    from runtime.parallel.dims import ParallelDims, rank_coords
    from runtime.parallel.pipeline.stages import split_layers
    from runtime.schema.facts import DTYPE_BYTES, PRECISION_POLICIES

    cfg = load_training_config(config_path, stage)
    par = cfg.parallel
    world = cfg.trainer.num_nodes * cfg.trainer.devices
    dims = ParallelDims.infer_dp(par.tp, par.pp, world)
    policy = PRECISION_POLICIES[cfg.precision.type]
    param_bytes = DTYPE_BYTES[policy.param]
    full = dict((name, p.numel()) for name, p in meta_model(cfg.model).named_parameters())
    layers_of_stage = split_layers(cfg.model.num_layers, par.pp)
    ranks = []
    for rank in range(world):
        c = rank_coords(rank, dims)
        first, last, layers = c["pp"] == 0, c["pp"] == par.pp - 1, layers_of_stage[c["pp"]]
        params = 0
        for name, numel in full.items():
            top = name.split(".")
            held = (int(top[1]) in layers if top[0] == "layers" else
                    first if top[0] == "embed" else last)  # final_norm, output
            if held:
                params += numel if "norm" in name else numel // par.tp
        optimizer_share = 1 / dims.dp if par.zero1 else 1
        state = (params * param_bytes            # parameters
                 + params * 4                    # gradients (accumulated in fp32 in every precision)
                 + params * 8 * optimizer_share  # Adam exp_avg, exp_avg_sq (fp32)
                 + (params * 4 * optimizer_share if policy.master_weights else 0))
        ranks.append({"rank": rank, "coords": c, "params": params, "own_state_bytes": int(state)})
    return {"model_params": sum(full.values()), "largest_tensor_bytes": max(full.values()) * param_bytes,
            "precision": cfg.precision.type, "layout": {"tp": par.tp, "pp": par.pp, "dp": dims.dp,
                                                        "zero1": par.zero1}, "ranks": ranks}


def make_hf_directory(config_path: str, out_dir: str, tokenizer: str, shard_bytes: int) -> None:
    """The fine-tuning case's start: the model as build_model initializes it, saved as sharded safetensors."""
    from runtime.config import load_training_config
    from runtime.convert.hf import save_hf_directory
    from runtime.models import build_model

    cfg = load_training_config(config_path)
    model = build_model(cfg.model)
    state = {name: t.detach() for name, t in model.state_dict().items()}
    save_hf_directory(out_dir, state, cfg.model, tokenizer, max_shard_bytes=shard_bytes)


# ---------------------------------------------------------------------------------------------------------------
# Sampling a process tree from outside

def _hwm(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _worker_rank(proc: psutil.Process, module: str) -> int | None:
    """The rank of a worker of `module` (its RANK variable); a one-process stage without RANK is rank 0. None for
    anything else (the job script's bash and tee, torchrun's agent, a forked child before its exec)."""
    try:
        if not any(module in part for part in proc.cmdline()):
            return None
        env = proc.environ()
    except (psutil.Error, OSError):
        return None
    return int(env["RANK"]) if "RANK" in env else (0 if module == "runtime.convert" else None)


def _saved(log: Path, marker: str | None) -> bool:
    """Whether the stage's output holds `marker` (rank 0's log line of the step the first save follows)."""
    try:
        return marker is not None and marker in log.read_text(errors="replace")
    except OSError:
        return False


def sample(cmd: list[str], *, cwd: str, env: dict, module: str, log: Path, interval: float, guard: int,
           timeout: float, save_marker: str | None = None) -> dict:
    """Run cmd (its own session), walk its process tree every `interval` s; per rank, the peak of the summed RSS
    of its processes and the largest VmHWM read. save_marker: the peaks are also kept apart before and after it
    appears in the output (the first save: its copy, where there is one, starts right after)."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    root = psutil.Process(proc.pid)
    rank_of: dict[int, int] = {}            # pid -> rank, once seen as a worker
    peak = collections.defaultdict(int)
    peak_at = {}
    split = {"before": collections.defaultdict(int), "after": collections.defaultdict(int)}
    first_save_at = None
    series = collections.defaultdict(list)  # rank -> [[s, MB], ...], one sample a second
    hwm = collections.defaultdict(int)
    total_peak, samples, aborted, min_available = 0, 0, None, psutil.virtual_memory().available
    start = time.monotonic()
    while proc.poll() is None:
        tick = time.monotonic()
        rss = collections.defaultdict(int)
        try:
            children = root.children(recursive=True)
        except psutil.Error:
            children = []
        for child in children:
            rank = rank_of.get(child.pid)
            if rank is None:
                rank = _worker_rank(child, module)
                if rank is None:
                    continue
                rank_of[child.pid] = rank
            try:
                rss[rank] += child.memory_info().rss
                hwm[rank] = max(hwm[rank], _hwm(child.pid))
            except (psutil.Error, OSError):
                continue
        if first_save_at is None and _saved(log, save_marker):
            first_save_at = round(tick - start, 1)
        side = split["before" if first_save_at is None else "after"]
        for rank, value in rss.items():
            if value > peak[rank]:
                peak[rank], peak_at[rank] = value, round(tick - start, 1)
            side[rank] = max(side[rank], value)
            if samples % max(1, round(1 / interval)) == 0:
                series[rank].append([round(tick - start, 1), round(value / MB)])
        total_peak = max(total_peak, sum(rss.values()))
        samples += 1
        available = psutil.virtual_memory().available
        min_available = min(min_available, available)
        if available < guard and aborted is None:
            aborted = (f"available host memory fell to {available / GIB:.2f} GiB (guard {guard / GIB:.2f} GiB) at "
                       f"{tick - start:.1f} s with the workers at {sum(rss.values()) / GIB:.2f} GiB RSS; killed")
            os.killpg(proc.pid, signal.SIGKILL)
        elif tick - start > timeout and aborted is None:
            aborted = f"ran past --timeout {timeout:.0f} s; killed"
            os.killpg(proc.pid, signal.SIGKILL)
        time.sleep(max(0.0, interval - (time.monotonic() - tick)))
    rc = proc.wait()
    out = {"rc": rc, "wall_s": round(time.monotonic() - start, 1), "samples": samples, "aborted": aborted,
           "peak_rss": dict(peak), "peak_at_s": peak_at, "hwm": dict(hwm), "total_peak_rss": total_peak,
           "min_available_bytes": min_available}
    if save_marker is not None:
        out.update(first_save_at_s=first_save_at, peak_rss_before_save=dict(split["before"]),
                   peak_rss_after_save=dict(split["after"]), rss_series_mb=dict(series))
    return out


# ---------------------------------------------------------------------------------------------------------------
# Rendering the cases with the tree's launcher

def tree_env(tree: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                              "MASTER_PORT")}
    env.update(PYTHONPATH=str(tree), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


def launcher(tree: Path, overrides: list[str], log: Path) -> None:
    cmd = [sys.executable, "-m", "launcher.cli", *overrides]
    result = subprocess.run(cmd, cwd=tree, env=tree_env(tree), capture_output=True, text=True)
    log.write_text(" ".join(cmd) + "\n" + result.stdout + result.stderr)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stdout[-2000:]}"
                           f"{result.stderr[-2000:]}")


def training_overrides(prefix: str, name: str, tp: int, pp: int, dp: int, zero1: bool, checkpoint: bool,
                       saves: bool = False) -> list:
    o = {**{f"model.{k}": v for k, v in MODEL.items()},
         "run.name": name, "trainer.devices": tp * pp * dp, "trainer.num_nodes": 1,
         "model.tensor_model_parallel_size": tp, "model.pipeline_model_parallel_size": pp,
         "model.zero1": str(zero1).lower(), "model.global_batch_size": dp, "trainer.max_steps": 2,
         "model.optim.sched.warmup_steps": 1, "trainer.val_check_interval": 0, "trainer.log_every_n_steps": 1,
         "trainer.preflight": "false", "exp_manager.create_tensorboard_logger": "false",
         "exp_manager.create_metrics_plot": "false", "precision.type": "fp32",
         "exp_manager.create_checkpoint_callback": str(checkpoint).lower()}
    if checkpoint:
        o.update({"exp_manager.checkpoint_callback_params.every_n_train_steps": 2,
                  "exp_manager.checkpoint_callback_params.save_top_k": -1})
    if saves:
        o.update({"exp_manager.create_checkpoint_callback": "true", "trainer.max_steps": SAVE_STEPS,
                  "exp_manager.checkpoint_callback_params.every_n_train_steps": SAVE_EVERY,
                  "exp_manager.checkpoint_callback_params.save_top_k": -1,
                  "exp_manager.checkpoint_callback_params.async_save": "true",
                  "exp_manager.checkpoint_callback_params.save_last": "true"})
    return [f"{prefix}.{k}={v}" for k, v in o.items()]


def render(case: str, tree: Path, work: Path, results: Path, export_source: Path | None) -> tuple[Path, Path]:
    """-> (the job script, the stage config) that the launcher's dry run wrote for this case."""
    stage, tp, pp, dp, zero1, _ = CASES[case]
    data = work / "data"
    common = [f"data_dir={data}", f"base_results_dir={results}", "--dry-run"]
    run = f"hm_{case}"
    if stage == "training":
        overrides = ["stages=[training]", "training=llama/tiny",
                     *training_overrides("training", run, tp, pp, dp, zero1, case == "tp2_checkpoint",
                                         case.endswith("_saves")), *common]
    elif stage == "fine_tuning":
        overrides = ["stages=[fine_tuning]", "fine_tuning=llama/tiny",
                     *training_overrides("fine_tuning", run, tp, pp, dp, zero1, False),
                     f"fine_tuning.model.restore_from_path={work / 'hf_model'}",
                     f"fine_tuning.model.tokenizer.model={data}/demo/tokenizer.json",
                     f"fine_tuning.model.data.data_prefix={data}/demo/blend.txt",
                     "fine_tuning.model.data.train_ds=null", "fine_tuning.model.data.validation_ds=null", *common]
    else:
        overrides = ["stages=[conversion]", "conversion=default", "training=llama/tiny",
                     f"training.run.name={run}", f"conversion.checkpoint_dir={export_source}",
                     f"conversion.tokenizer_model={data}/demo/tokenizer.json", "conversion.overwrite=true",
                     *common]
    stage_dir = results / run / stage
    launcher(tree, overrides, work / f"render_{case}.log")
    configs = sorted(stage_dir.glob(f"launches/*/{stage}_config.yaml"), key=lambda p: p.stat().st_mtime)
    return stage_dir / f"{stage}.local.sh", configs[-1]


def helper(tree: Path, *args: str) -> str:
    result = subprocess.run([sys.executable, str(Path(__file__).resolve()), *args], cwd=tree, env=tree_env(tree),
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"host_memory.py {' '.join(args)} failed:\n{result.stderr[-3000:]}")
    return result.stdout


def tail(path: Path, lines: int = 6) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# ---------------------------------------------------------------------------------------------------------------

def measure(args) -> dict:
    tree, work = Path(args.tree).resolve(), Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    results = work / f"results_{args.label}"
    commit = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True).stdout.strip())
    report = {"label": args.label, "tree": str(tree), "commit": commit, "tree_has_uncommitted_changes": dirty,
              "machine": {"cpus": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / GIB, 1),
                          "python": platform.python_version()},
              "interval_s": args.interval, "size": args.size, "model": MODEL, "cases": {}}
    env = tree_env(tree)

    def save():
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(report, indent=1) + "\n")

    # The demo corpus and tokenizer (the README's first command's data stage), once per --work.
    if not (work / "data/demo/blend.txt").is_file():
        print("data: demo corpus ...", flush=True)
        launcher(tree, ["stages=[data_preparation]", "data_preparation=demo", f"data_dir={work / 'data'}",
                        f"base_results_dir={work / 'results_data'}"], work / "data_preparation.log")

    # The fixed process overhead: an idle worker, torchrun with 2 processes.
    print("overhead: idle torchrun worker x2 ...", flush=True)
    idle = sample([sys.executable, "-m", "runtime.torchrun", "--standalone", "--nnodes", "1", "--nproc_per_node",
                   "2", str(HERE / "host_memory_idle.py")], cwd=str(tree), env=env, module="host_memory_idle",
                  log=work / f"idle_{args.label}.log", interval=args.interval, guard=int(args.guard_gib * GIB),
                  timeout=300)
    if idle["rc"] != 0 or not idle["peak_rss"]:
        raise RuntimeError(f"the idle workers failed ({idle['rc']}): {tail(work / f'idle_{args.label}.log')}")
    overhead = max(idle["peak_rss"].values())
    report["overhead"] = {"bytes": overhead, "per_rank_peak_rss": idle["peak_rss"], "per_rank_hwm": idle["hwm"],
                          "wall_s": idle["wall_s"]}
    print(f"  fixed overhead {overhead / MB:,.0f} MB (ranks: "
          f"{', '.join(f'{v / MB:,.0f}' for v in idle['peak_rss'].values())})", flush=True)
    save()

    export_source = None
    for case in args.cases:
        stage, tp, pp, dp, zero1, what = CASES[case]
        if shutil.disk_usage(work).free < 8 * GIB:
            print(f"warning: {shutil.disk_usage(work).free / GIB:.1f} GiB free under {work}", flush=True)
        shutil.rmtree(results / f"hm_{case}", ignore_errors=True)  # a fresh run: nothing to resume
        entry = {"what": what, "stage": stage}
        report["cases"][case] = entry
        try:
            if case == "finetune_tp2" and not (work / "hf_model/model.safetensors.index.json").is_file():
                print("hf_model: building the model and saving sharded safetensors ...", flush=True)
                script, config = render("one_process", tree, work, results, None)  # the same model
                started = time.monotonic()
                helper(tree, "_make_hf", str(config), str(work / "hf_model"),
                       str(work / "data/demo/tokenizer.json"), str(args.shard_mb * 10 ** 6))
                print(f"  {time.monotonic() - started:.0f} s", flush=True)
            if case == "export":
                export_source = results / "hm_tp2_checkpoint/training/checkpoints"
                if not export_source.is_dir():
                    raise RuntimeError(f"{export_source} does not exist: run the tp2_checkpoint case first")
            script, config = render(case, tree, work, results, export_source)
            if stage == "conversion":  # the largest tensor of the checkpointed model (its source run's config)
                source_config = sorted((results / "hm_tp2_checkpoint/training").glob(
                    "launches/*/training_config.yaml"))[-1]
                shapes = json.loads(helper(tree, "_state", str(source_config), "training"))
                entry["largest_tensor_bytes"] = shapes["largest_tensor_bytes"]
                entry["model_params"] = shapes["model_params"]
                module = "runtime.convert"
            else:
                entry.update(json.loads(helper(tree, "_state", str(config), stage)))
                module = "runtime.train"
            entry["config"], entry["script"] = str(config), str(script)
            print(f"{case}: {what} (free {psutil.virtual_memory().available / GIB:.1f} GiB) ...", flush=True)
            marker = f"step {SAVE_EVERY}/{SAVE_STEPS} " if case.endswith("_saves") else None
            run = sample(["bash", str(script)], cwd=str(tree), env=env, module=module,
                         log=work / f"{case}_{args.label}.log", interval=args.interval,
                         guard=int(args.guard_gib * GIB), timeout=args.timeout, save_marker=marker)
            entry.update(run)
            entry["log_tail"] = tail(work / f"{case}_{args.label}.log", 8)
        except Exception as error:  # one case failing must not lose the others
            entry["error"] = str(error)
            print(f"  error: {error}", flush=True)
            save()
            continue
        # Targets
        if stage == "conversion":
            entry["target_bytes"] = 3 * entry["largest_tensor_bytes"] + overhead
            rows = [{"rank": 0, "own_state_bytes": None}]
        else:
            for r in entry["ranks"]:
                r["target_bytes"] = int(1.25 * r["own_state_bytes"] + overhead)
            rows = entry["ranks"]
        for r in rows:
            for side in ("before", "after"):
                if f"peak_rss_{side}_save" in entry:
                    peak = entry[f"peak_rss_{side}_save"].get(r["rank"])
                    r[f"peak_{side}_save_per_own_state"] = peak and round(peak / r["own_state_bytes"], 3)
                    r[f"peak_{side}_save_over_overhead_per_own_state"] = \
                        peak and round((peak - overhead) / r["own_state_bytes"], 3)
            r["peak_rss"] = entry["peak_rss"].get(r["rank"])
            r["hwm"] = entry["hwm"].get(r["rank"])
            target = r.get("target_bytes", entry.get("target_bytes"))
            r["within_target"] = None if r["peak_rss"] is None else r["peak_rss"] <= target
        if stage == "conversion":
            entry["ranks"] = rows
        status = "ok" if entry["rc"] == 0 and not entry["aborted"] else f"rc {entry['rc']} {entry['aborted'] or ''}"
        print(f"  {status}; {entry['wall_s']} s; peaks "
              f"{', '.join(f'{k}: {v / MB:,.0f} MB' for k, v in sorted(entry['peak_rss'].items()))}", flush=True)
        save()
    print(table(report))
    return report


def table(report: dict) -> str:
    lines = [f"{report['label']} ({report['commit']}): fixed overhead {report['overhead']['bytes'] / MB:,.0f} MB",
             f"{'case':<16} {'rank':>4} {'own state MB':>13} {'peak RSS MB':>12} {'VmHWM MB':>9} {'target MB':>10} "
             f"{'peak/target':>11}  {'wall s':>6}"]
    for case, e in report["cases"].items():
        if "error" in e or "rc" not in e:
            lines.append(f"{case:<16} error: {e.get('error')}")
            continue
        for r in e["ranks"]:
            target = r.get("target_bytes", e.get("target_bytes"))
            own = f"{r['own_state_bytes'] / MB:,.0f}" if r["own_state_bytes"] else "-"
            peak = f"{r['peak_rss'] / MB:,.0f}" if r["peak_rss"] else "-"
            hwm = f"{r['hwm'] / MB:,.0f}" if r["hwm"] else "-"
            ratio = f"{r['peak_rss'] / target:.2f}" if r["peak_rss"] else "-"
            saves = ""
            if "peak_after_save_per_own_state" in r:
                saves = (f"  (peak - overhead) / own state: {r['peak_before_save_over_overhead_per_own_state']} "
                         f"before the first save, {r['peak_after_save_over_overhead_per_own_state']} after")
            lines.append(f"{case:<16} {r['rank']:>4} {own:>13} {peak:>12} {hwm:>9} {target / MB:>10,.0f} {ratio:>11}"
                         f"  {e['wall_s']:>6}{saves}")
        if e["rc"] != 0 or e["aborted"]:
            lines.append(f"{'':<16} exit {e['rc']}; {e['aborted'] or ''} {e['log_tail'].splitlines()[-1:]}")
    return "\n".join(lines)


def markdown(before: dict, after: dict | None) -> str:
    """The README's table: case | rank | own state | peak before | peak after | target (MB = 10^6 bytes)."""
    def gb(value):
        return f"{value / 1e9:.2f} GB" if value else "-"

    rows = ["| case | rank | own state | peak before | peak after | target |", "| --- | --- | --- | --- | --- | --- |"]
    for case, e in before["cases"].items():
        if "ranks" not in e:
            rows.append(f"| {e['what']} | - | - | error: {e.get('error', '')[:80]} | - | - |")
            continue
        other = (after or {}).get("cases", {}).get(case, {})
        for r in e["ranks"]:
            target = r.get("target_bytes", e.get("target_bytes"))
            peak_after = "pending"
            if after is not None:
                match = [x for x in other.get("ranks", []) if x["rank"] == r["rank"]]
                peak_after = gb(match[0]["peak_rss"]) if match and match[0].get("peak_rss") else \
                    ("error" if other else "not run")
            peak = gb(r["peak_rss"]) + ("" if e["rc"] == 0 and not e["aborted"] else f" (exit {e['rc']})")
            own = gb(r["own_state_bytes"]) if r["own_state_bytes"] else \
                f"largest tensor {gb(e.get('largest_tensor_bytes'))}"
            rows.append(f"| {e['what']} | {r['rank']} | {own} | {peak} | {peak_after} | {gb(target)} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["_state"], ["_make_hf"]):  # import the runtime of --tree, not a module beside this file
        sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
    if argv[:1] == ["_state"]:
        print(json.dumps(own_state(argv[1], argv[2])))
        return 0
    if argv[:1] == ["_make_hf"]:
        make_hf_directory(argv[1], argv[2], argv[3], int(argv[4]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", default=str(HERE.parent), help="source tree to measure (cwd and PYTHONPATH)")
    parser.add_argument("--work", default=None, help="working directory (default: a new temporary directory)")
    parser.add_argument("--label", default="run", help="before / after: names the results directory under --work")
    parser.add_argument("--out", default=None, help="write the JSON report here")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    parser.add_argument("--interval", type=float, default=0.1, help="sampling interval, seconds")
    parser.add_argument("--guard-gib", type=float, default=1.5, help="kill a case when available memory falls under")
    parser.add_argument("--timeout", type=float, default=1200, help="per case, seconds")
    parser.add_argument("--size", default="0.45b", choices=sorted(MODELS), help="the model (see above)")
    parser.add_argument("--shard-mb", type=int, default=300, help="safetensors shard size of the HF directory")
    parser.add_argument("--markdown", nargs="+", metavar="JSON", help="print the README table of BEFORE [AFTER]")
    args = parser.parse_args(argv)
    if args.markdown:
        loaded = [json.loads(Path(p).read_text()) for p in args.markdown]
        print(markdown(loaded[0], loaded[1] if len(loaded) > 1 else None))
        return 0
    global MODEL
    MODEL = MODELS[args.size]
    args.cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in args.cases if c not in CASES]
    if unknown:
        parser.error(f"unknown cases {unknown}; choose from {', '.join(CASES)}")
    if args.work is None:
        args.work = tempfile.mkdtemp(prefix="host_memory_")
    print(f"tree {args.tree}, work {args.work}", flush=True)
    measure(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Device check: the CUDA path's exactness against CPU, and the bf16 MFU of a ~1B Llama, in one short run.

Run it through the shell wrapper, which puts a hard time limit on the whole run and keeps a log:

    bash benchmarks/device_check.sh              # on a GPU machine (H100 / H200): well under 8 minutes
    bash benchmarks/device_check.sh --cpu-smoke  # the same code paths on CPU at tiny sizes (a minute or two)

1. Exactness. A tiny Llama and a tiny GPT (tied embeddings), fp32, built by runtime.models.build_model from the same
   config (hence the same init), trained a few steps by runtime.step.train_step (parallelize_model ->
   DataParallelConfig -> ShardedAdamW, the trainer's own path, one process) on the same batches (2 micro-batches
   per step, a loss mask with zeros) on CPU and on CUDA, TF32 off and deterministic algorithms on. fp32 is not
   bitwise across devices (different kernels, different summation orders), so the check is a tolerance: every
   step's loss and gradient norm within rtol 1e-4, and every parameter tensor's relative L2 difference
   ||cuda - cpu|| / max(||cpu||, 0.02 sqrt(numel)) within 1e-4 at the end (the floor, the init scale, is for biases
   near zero; see NORM_FLOOR_STD); the largest element-wise differences are reported beside it.
   A second CUDA run checks run-to-run determinism (bitwise). With 2 or more GPUs the same training also runs as 2
   processes over NCCL (torchrun, dp=2, plain and ZeRO-1) against the one-process CPU reference; with one GPU that
   part is skipped with a line saying so. Then an asynchronous checkpoint save streamed from the device through
   a one-slot ring while the next step runs (issue 56) is checked bitwise against the whole-copy save of the step.
2. MFU. A ~1.1B Llama (TinyLlama's shape: hidden 2048, 22 layers, 32 heads, 4 KV groups, SwiGLU 5632, vocabulary
   32000) at sequence 2048 under the runtime's `mixed_precision` policy (bf16 weights and compute, fp32 master
   weights, fp32 gradients; runtime/precision.py), a few warm-up steps then timed ones. Tokens/s, model TFLOP/s by
   the project's own formula (runtime/schema/facts.py flops_per_token, via runtime.metrics.model_flops_per_token),
   MFU against facts.PEAK_TFLOPS for the card (h100 / h200: 989 dense bf16), and peak GPU memory
   (torch.cuda.max_memory_allocated). A configuration that runs out of memory is retried with full activation
   checkpointing.

Everything is printed as plain lines; with $OUT set (or --json PATH) a JSON summary is written too. The exit status
is 0 when every exactness check passed, 1 when one failed, 2 when CUDA is absent (without --cpu-smoke).
"""
from __future__ import annotations

import os

# Before torch initializes CUDA: cuBLAS's deterministic workspace (torch.use_deterministic_algorithms asks for it).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from runtime.metrics import model_flops_per_token, peak_tflops  # noqa: E402
from runtime.micro_batch import MicroBatch  # noqa: E402
from runtime.models import ModelConfig, build_model  # noqa: E402
from runtime.parallel import (AdamWConfig, DataParallelConfig, ParallelDims, ShardedAdamW, Topology,  # noqa: E402
                              parallelize_model)
from runtime.schema.facts import PEAK_TFLOPS  # noqa: E402
from runtime.step import train_step  # noqa: E402

LR, CLIP, WEIGHT_DECAY, BETAS = 1e-3, 1.0, 0.1, (0.9, 0.95)
RTOL = 1e-4          # losses, gradient norms, and each parameter tensor's relative L2 difference
# A tensor's L2 norm is floored at the init scale (init_method_std 0.02 per element) before dividing by it: biases
# start at zero and stay tiny, and some gradients are zero in exact arithmetic (GPT's key bias: adding a constant to
# every key shifts all of a query's scores alike), so their rounding noise, which Adam normalizes into updates of
# up to lr, would otherwise read as a large relative difference of a near-zero tensor.
NORM_FLOOR_STD = 0.02
ELEMENT_ATOL = 1e-6  # for the element-wise count reported beside it (torch.isclose(rtol=RTOL, atol=this))
START = time.perf_counter()


def say(line: str = "") -> None:
    print(line, flush=True)


def elapsed() -> float:
    return time.perf_counter() - START


# ---- sizes ---------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ExactSizes:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    seq: int
    micro_batch: int
    micro_batches: int  # per step (gradient accumulation); split over ranks in the dp=2 run
    steps: int

    def config(self, architecture: str) -> ModelConfig:
        return ModelConfig(
            architecture=architecture, vocab_size=self.vocab, hidden_size=self.hidden, num_layers=self.layers,
            num_attention_heads=self.heads,
            ffn_hidden_size=4 * self.hidden if architecture == "gpt" else _swiglu_ffn(self.hidden),
            max_position_embeddings=self.seq, num_query_groups=self.kv_heads if architecture == "llama" else None,
            share_embeddings_and_output_weights=architecture == "gpt", seed=1234,
        )


EXACT = {
    "gpu": ExactSizes(hidden=256, layers=4, heads=8, kv_heads=4, vocab=4096, seq=256, micro_batch=4,
                      micro_batches=2, steps=6),
    "smoke": ExactSizes(hidden=64, layers=2, heads=4, kv_heads=2, vocab=512, seq=32, micro_batch=2,
                        micro_batches=2, steps=3),
}


@dataclasses.dataclass(frozen=True)
class MfuSizes:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int
    runs: tuple[tuple[int, int, str | None], ...]  # (micro-batch size, micro-batches per step, checkpointing)
    warmup: int
    steps: int

    def config(self) -> ModelConfig:
        return ModelConfig(architecture="llama", vocab_size=self.vocab, hidden_size=self.hidden,
                           num_layers=self.layers, num_attention_heads=self.heads, ffn_hidden_size=self.ffn,
                           max_position_embeddings=self.seq, num_query_groups=self.kv_heads, seed=1234)


MFU = {
    # TinyLlama-1.1B's shape. Static memory under mixed_precision: 2 (bf16 weights) + 4 (fp32 master) + 4 (fp32
    # grads) + 8 (Adam moments) = 18 bytes per parameter, ~20 GB; activations at 4 x 2048 tokens without
    # checkpointing are roughly 20-30 GB, so the first run fits 78 GiB with room. The second doubles the tokens per
    # micro-batch under full activation checkpointing.
    "gpu": MfuSizes(hidden=2048, layers=22, heads=32, kv_heads=4, ffn=5632, vocab=32000, seq=2048,
                    runs=((4, 2, None), (8, 2, "full")), warmup=3, steps=15),
    "smoke": MfuSizes(hidden=128, layers=2, heads=4, kv_heads=2, ffn=352, vocab=1024, seq=64,
                      runs=((2, 2, None), (2, 2, "full")), warmup=1, steps=2),
}


def _swiglu_ffn(hidden: int) -> int:
    """Llama's 8/3 x hidden, rounded up to a multiple of 16."""
    return -(-8 * hidden // 3 // 16) * 16


# ---- the runtime's training path -----------------------------------------------------------------------------

def solo_topology() -> Topology:
    return Topology.build(ParallelDims(tp=1, pp=1, dp=1, world_size=1))


def make_batches(sizes: ExactSizes, seed: int = 0) -> list[list[tuple]]:
    """steps x micro-batches of (input_ids, labels, loss_mask) on CPU, from a private generator: every process
    that calls this gets the same batches."""
    gen = torch.Generator().manual_seed(seed)
    steps = []
    for _ in range(sizes.steps):
        micro = []
        for _ in range(sizes.micro_batches):
            tokens = torch.randint(0, sizes.vocab, (sizes.micro_batch, sizes.seq + 1), generator=gen)
            mask = (torch.rand(sizes.micro_batch, sizes.seq, generator=gen) >= 0.1).to(torch.float32)
            micro.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), mask))
        steps.append(micro)
    return steps


@dataclasses.dataclass
class Trained:
    losses: list[float]
    grad_norms: list[float]
    params: dict[str, torch.Tensor]  # name -> fp32 CPU copy, in the data-parallel owner's names
    seconds: float


def train_small(cfg: ModelConfig, device: torch.device, batches: list[list[tuple]], topo: Topology | None = None,
                zero1: bool = False) -> Trained:
    """build_model -> parallelize_model(device, DataParallelConfig(fp32)) -> ShardedAdamW -> train_step per step.
    With dp > 1 each rank trains on its share of every step's micro-batches."""
    start = time.perf_counter()
    topo = topo or solo_topology()
    model = parallelize_model(build_model(cfg), topo, device=device,
                              data_parallel=DataParallelConfig(precision="fp32", zero1=zero1, seed=0))
    optimizer = ShardedAdamW(model, AdamWConfig(lr=LR, weight_decay=WEIGHT_DECAY, betas=BETAS))
    losses, norms = [], []
    for step_batches in batches:
        mine = step_batches[topo.dp.rank::topo.dp.size]
        result = train_step(model, optimizer, [MicroBatch(*mb).to(device) for mb in mine], topo, lr=LR, clip=CLIP)
        losses.append(result.loss)
        norms.append(result.grad_norm)
    params = {name: p.detach().to("cpu", torch.float32).clone() for name, p in model.data_parallel.named_params}
    del model, optimizer
    return Trained(losses, norms, params, time.perf_counter() - start)


def compare(ref: Trained, other: Trained) -> dict:
    """Differences of `other` from the reference: relative per step and per tensor, and element-wise extremes."""
    def rel(a: float, b: float) -> float:
        return abs(a - b) / max(abs(b), 1e-12)

    if ref.params.keys() != other.params.keys():
        raise RuntimeError(f"parameter names differ: {sorted(ref.params.keys() ^ other.params.keys())}")
    tensor_rel, worst, unfloored, max_abs, max_rel, outside, total, bitwise = 0.0, "", 0.0, 0.0, 0.0, 0, 0, True
    for name, b in ref.params.items():
        a = other.params[name]
        diff = (a.double() - b.double())
        norm = b.double().norm().item()
        r = diff.norm().item() / max(norm, NORM_FLOOR_STD * math.sqrt(b.numel()))
        unfloored = max(unfloored, diff.norm().item() / max(norm, 1e-30))
        if r >= tensor_rel:
            tensor_rel, worst = r, name
        max_abs = max(max_abs, diff.abs().max().item())
        big = b.abs() >= 1e-3  # element-wise relative differences over near-zero values say nothing
        if big.any():
            max_rel = max(max_rel, (diff.abs()[big] / b.double().abs()[big]).max().item())
        outside += int((~torch.isclose(a, b, rtol=RTOL, atol=ELEMENT_ATOL)).sum())
        total += b.numel()
        bitwise = bitwise and torch.equal(a, b)
    result = {
        "loss_max_rel": max(rel(a, b) for a, b in zip(other.losses, ref.losses)),
        "grad_norm_max_rel": max(rel(a, b) for a, b in zip(other.grad_norms, ref.grad_norms)),
        "param_tensor_max_rel_l2": tensor_rel, "param_worst_tensor": worst,
        "param_tensor_max_rel_l2_unfloored": unfloored,
        "param_max_abs": max_abs, "param_max_abs_in_lr": max_abs / LR, "param_max_rel_elementwise": max_rel,
        "param_elements_outside_isclose": outside, "param_elements": total,
        "losses_bitwise": other.losses == ref.losses, "params_bitwise": bitwise,
    }
    result["passed"] = (result["loss_max_rel"] <= RTOL and result["grad_norm_max_rel"] <= RTOL
                        and tensor_rel <= RTOL)
    return result


def report_comparison(label: str, c: dict) -> None:
    verdict = "PASS" if c["passed"] else "FAIL"
    say(f"{label}: {verdict}  loss max rel diff {c['loss_max_rel']:.3e}, grad-norm max rel diff "
        f"{c['grad_norm_max_rel']:.3e}, param max rel L2 diff per tensor {c['param_tensor_max_rel_l2']:.3e} "
        f"({c['param_worst_tensor']}; norms floored at {NORM_FLOOR_STD:g} x sqrt(numel), unfloored "
        f"{c['param_tensor_max_rel_l2_unfloored']:.3e}); tolerance {RTOL:g}")
    say(f"{label}:   element-wise: max abs diff {c['param_max_abs']:.3e} ({c['param_max_abs_in_lr']:.3f} x lr), "
        f"max rel diff {c['param_max_rel_elementwise']:.3e} (over |p| >= 1e-3), "
        f"{c['param_elements_outside_isclose']} of {c['param_elements']} elements outside "
        f"isclose(rtol={RTOL:g}, atol={ELEMENT_ATOL:g}); bitwise: losses {c['losses_bitwise']}, "
        f"params {c['params_bitwise']}")


def set_exact_mode(on: bool, warn_only: bool = False) -> None:
    """fp32 exactness: no TF32 anywhere, deterministic kernels. Strict by default: with warn_only, torch keeps some
    kernels non-deterministic and only warns (SDPA's memory-efficient backward among them), so warn_only is the
    fallback for an op that has no deterministic kernel at all, and its warnings are reported."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = on
    torch.backends.cudnn.benchmark = False
    torch.set_float32_matmul_precision("highest")
    torch.use_deterministic_algorithms(on, warn_only=warn_only)


# ---- part 1: exactness ---------------------------------------------------------------------------------------

def exactness(sizes: ExactSizes, device: torch.device, smoke: bool) -> tuple[dict, dict[str, Trained], bool]:
    say(f"== exactness: fp32 {'CPU vs CPU (smoke)' if smoke else 'CUDA vs CPU'}; hidden {sizes.hidden}, "
        f"{sizes.layers} layers, {sizes.heads} heads (llama {sizes.kv_heads} KV groups), vocab {sizes.vocab}, "
        f"seq {sizes.seq}, {sizes.micro_batches} micro-batches of {sizes.micro_batch} per step, {sizes.steps} steps, "
        f"lr {LR:g}, clip {CLIP:g}")
    batches = make_batches(sizes)
    results, refs, ok = {}, {}, True
    for architecture in ("llama", "gpt"):
        cfg = sizes.config(architecture)
        mode = "strict"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                set_exact_mode(True)
                ref, run1, run2 = (train_small(cfg, d, batches) for d in (torch.device("cpu"), device, device))
            except RuntimeError as error:
                if "determinis" not in str(error):
                    raise
                mode = f"warn_only (strict mode stopped: {str(error).splitlines()[0][:200]})"
                say(f"{architecture}: deterministic algorithms: {mode}; rerunning with warn_only=True")
                set_exact_mode(True, warn_only=True)
                ref, run1, run2 = (train_small(cfg, d, batches) for d in (torch.device("cpu"), device, device))
        refs[architecture] = ref
        params = sum(p.numel() for p in ref.params.values())
        say(f"{architecture}: {params / 1e6:.2f}M params; cpu {ref.seconds:.1f} s, {device.type} "
            f"{run1.seconds:.1f} s + {run2.seconds:.1f} s")
        say(f"{architecture}: losses cpu    " + " ".join(f"{x:.6f}" for x in ref.losses))
        say(f"{architecture}: losses {device.type:<6} " + " ".join(f"{x:.6f}" for x in run1.losses))
        c = compare(ref, run1)
        report_comparison(f"{architecture} {device.type} vs cpu", c)
        determinism = compare(run1, run2)
        det_ok = determinism["losses_bitwise"] and determinism["params_bitwise"]
        say(f"{architecture} {device.type} run-to-run: {'PASS' if det_ok else 'FAIL'} bitwise identical "
            f"losses and params: {det_ok} (loss max rel diff {determinism['loss_max_rel']:.3e}, param max rel L2 "
            f"{determinism['param_tensor_max_rel_l2']:.3e})")
        nondeterministic = sorted({str(w.message).splitlines()[0][:160] for w in caught
                                   if "determinis" in str(w.message)})
        for message in nondeterministic:
            say(f"{architecture}: warning from deterministic mode: {message}")
        results[architecture] = {"vs_cpu": c, "run_to_run": determinism, "run_to_run_bitwise": det_ok,
                                 "params": params, "losses_cpu": ref.losses, f"losses_{device.type}": run1.losses,
                                 "deterministic_mode": mode, "deterministic_mode_warnings": nondeterministic}
        ok = ok and c["passed"] and det_ok
    set_exact_mode(False)
    return results, refs, ok


# ---- part 1c: an asynchronous save streamed through the ring (issue 56) ---------------------------------------

def streamed_save(sizes: ExactSizes, device: torch.device) -> tuple[dict, bool]:
    """The Llama trained a step on `device`, saved twice at that step: the old way (the whole state copied to the
    host at the save) and streamed (runtime/checkpoint/staging.py: on CUDA, 16 MiB chunks copied on a side stream
    into one page-locked ring slot, the next step's update bringing the unwritten ones in before it changes them),
    the next step run right after the streamed save starts. The two files hold the same tensors, bitwise."""
    from runtime.checkpoint import Checkpointer, full_tensors, open_storage, read_rank_files
    from runtime.schema.facts import CHECKPOINT_CHUNK_BYTES

    batches, topo = make_batches(sizes), solo_topology()
    model = parallelize_model(build_model(sizes.config("llama")), topo, device=device,
                              data_parallel=DataParallelConfig(precision="fp32", seed=0))
    optimizer = ShardedAdamW(model, AdamWConfig(lr=LR, weight_decay=WEIGHT_DECAY, betas=BETAS))

    def step(micro_batches):
        train_step(model, optimizer, [MicroBatch(*mb).to(device) for mb in micro_batches], topo, lr=LR, clip=CLIP)

    step(batches[0])
    with tempfile.TemporaryDirectory(prefix="nxdt_device_check_") as root:
        kwargs = dict(rank=0, world_size=1, token="0", pin_memory=device.type == "cuda")
        Checkpointer(f"{root}/whole", async_save=False, **kwargs).save(1, model, optimizer, topo, extra={"step": 1},
                                                                      config={})
        streamed = Checkpointer(f"{root}/streamed", deferred_copy=True, ring_bytes=CHECKPOINT_CHUNK_BYTES, **kwargs)
        began = time.perf_counter()
        streamed.save(1, model, optimizer, topo, extra={"step": 1}, config={})
        snapshot = streamed._snapshot
        step(batches[1])  # its update waits for what the ring cannot hold
        streamed.wait()
        seconds = time.perf_counter() - began
        a, b = (full_tensors(read_rank_files(open_storage(f"{root}/{kind}"), "step_00000001.0"))
                for kind in ("whole", "streamed"))
        names = sorted(a.names())
        equal = names == sorted(b.names()) and all(
            torch.equal(a.get(name, key), b.get(name, key)) for name in names
            for key in ("value", "exp_avg", "exp_avg_sq"))
    result = {"saved_bytes": streamed.last_host_bytes, "ring_bytes": streamed.staging_bytes,
              "staged_by_update_bytes": snapshot.staged_bytes, "transfer": type(snapshot.transfer).__name__,
              "seconds": seconds, "bitwise_equal": equal}
    say(f"streamed save on {device.type} ({result['transfer']}): {result['saved_bytes'] / 2**20:.1f} MiB through a "
        f"{result['ring_bytes'] / 2**20:.0f} MiB ring, {result['staged_by_update_bytes'] / 2**20:.1f} MiB of it "
        f"brought in by the next update; {'PASS' if equal else 'FAIL'} bitwise equal to the whole copy's file")
    del model, optimizer
    return result, equal


# ---- part 1b: two processes (NCCL on 2 GPUs; gloo on CPU in the smoke run) -----------------------------------

def two_process(sizes: ExactSizes, refs: dict[str, Trained], smoke: bool, timeout_s: int, warn_only: bool
                ) -> tuple[dict, bool]:
    backend = "gloo" if smoke else "nccl"
    if not smoke and torch.cuda.device_count() < 2:
        line = (f"skipped: torch sees {torch.cuda.device_count()} CUDA device(s); the dp=2 NCCL run needs 2 "
                f"(torchrun --nproc_per_node 2)")
        say(f"== two processes (NCCL, dp=2): {line}")
        return {"skipped": line}, True
    say(f"== two processes: torchrun --nproc_per_node 2, {backend}, dp=2 (plain and ZeRO-1), "
        f"each rank one of the {sizes.micro_batches} micro-batches, against the one-process CPU reference")
    results, ok = {}, True
    with tempfile.TemporaryDirectory(prefix="device_check_") as tmp:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                   str(Path(__file__).resolve()), "--dp-worker", tmp] + (["--cpu-smoke"] if smoke else []) \
            + (["--warn-only"] if warn_only else [])
        start = time.perf_counter()
        try:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
        except subprocess.TimeoutExpired:
            say(f"two processes: FAIL: torchrun did not finish in {timeout_s} s")
            return {"error": f"timeout {timeout_s} s"}, False
        seconds = time.perf_counter() - start
        if proc.returncode != 0:
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
            say(f"two processes: FAIL: torchrun exited {proc.returncode}; its last lines:")
            for line in tail:
                say(f"    {line}")
            return {"error": f"exit {proc.returncode}", "tail": tail}, False
        say(f"two processes: torchrun took {seconds:.1f} s (process start-up included)")
        for architecture, ref in refs.items():
            for zero1 in (False, True):
                label = f"{architecture} dp=2{' zero1' if zero1 else ''} {backend} vs 1-process cpu"
                saved = torch.load(Path(tmp) / f"{architecture}_zero1{int(zero1)}.pt")
                c = compare(ref, Trained(saved["losses"], saved["grad_norms"], saved["params"], 0.0))
                report_comparison(label, c)
                results[label] = c
                ok = ok and c["passed"]
    return results, ok


def dp_worker(out_dir: str, smoke: bool, warn_only: bool) -> None:
    """One rank of the dp=2 run (started by torchrun): joins the world as the trainer does (runtime.device)."""
    from runtime.device import init_device, shutdown

    set_exact_mode(True, warn_only=warn_only)
    device = init_device("cpu" if smoke else "gpu")
    sizes = EXACT["smoke" if smoke else "gpu"]
    batches = make_batches(sizes)
    topo = Topology.build(ParallelDims(tp=1, pp=1, dp=2, world_size=2))
    for architecture in ("llama", "gpt"):
        for zero1 in (False, True):
            trained = train_small(sizes.config(architecture), device.torch_device, batches, topo, zero1=zero1)
            if device.is_main:
                torch.save({"losses": trained.losses, "grad_norms": trained.grad_norms, "params": trained.params},
                           Path(out_dir) / f"{architecture}_zero1{int(zero1)}.pt")
            device.barrier()
    del topo
    gc.collect()
    shutdown(device)


# ---- part 2: MFU ---------------------------------------------------------------------------------------------

def mfu_run(sizes: MfuSizes, device: torch.device, micro_batch: int, micro_batches: int, checkpointing: str | None,
            peak: float | None, precision: str) -> dict:
    cfg = sizes.config()
    start = time.perf_counter()
    model = build_model(cfg)
    params = model.num_params()
    built = time.perf_counter() - start
    topo = solo_topology()
    model = parallelize_model(model, topo, activation_checkpointing=checkpointing, device=device,
                              data_parallel=DataParallelConfig(precision=precision, seed=0))
    optimizer = ShardedAdamW(model, AdamWConfig(lr=3e-4, weight_decay=WEIGHT_DECAY, betas=BETAS))
    placed = time.perf_counter() - start - built
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(micro_batches):
        tokens = torch.randint(0, cfg.vocab_size, (micro_batch, sizes.seq + 1), generator=gen).to(device)
        batches.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), None))
    tokens_per_step = micro_batch * micro_batches * sizes.seq
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    losses, times = [], []
    for index in range(sizes.warmup + sizes.steps):
        sync()
        t0 = time.perf_counter()
        result = train_step(model, optimizer, batches, topo, lr=3e-4, clip=CLIP)
        sync()
        if index >= sizes.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(result.loss)
    per_token = model_flops_per_token(cfg, sizes.seq)
    median = statistics.median(times)
    tokens_s = tokens_per_step / median
    tflops = per_token * tokens_s / 1e12
    memory = (torch.cuda.max_memory_allocated(device) if cuda
              else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 2**30
    del model, optimizer, batches
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return {
        "params": params, "micro_batch": micro_batch, "micro_batches": micro_batches, "seq": sizes.seq,
        "activation_checkpointing": checkpointing or "none", "precision": precision,
        "tokens_per_step": tokens_per_step, "build_s": built, "place_s": placed,
        "step_s_median": median, "step_s_min": min(times), "step_s_max": max(times), "timed_steps": len(times),
        "tokens_per_s": tokens_s, "tokens_per_s_mean": tokens_per_step * len(times) / sum(times),
        "flops_per_token": per_token, "tflops": tflops, "peak_tflops": peak,
        "mfu": tflops / peak if peak else None,
        "peak_memory_gib": memory, "memory_kind": "torch.cuda.max_memory_allocated" if cuda else "host max RSS",
        "losses": losses,
    }


def mfu(sizes: MfuSizes, device: torch.device, hardware: str, precision: str, deadline_s: float) -> tuple[list, str]:
    peak = peak_tflops(hardware)
    say(f"== MFU: llama hidden {sizes.hidden}, {sizes.layers} layers, {sizes.heads} heads, {sizes.kv_heads} KV "
        f"groups, SwiGLU {sizes.ffn}, vocab {sizes.vocab}, seq {sizes.seq}, precision {precision}"
        + (" (bf16 weights and compute, fp32 master weights and gradients)" if precision == "mixed_precision" else "")
        + f"; {sizes.warmup} warm-up + {sizes.steps} timed steps per "
        f"run; {peak.describe()}")
    runs = []
    for micro_batch, micro_batches, checkpointing in sizes.runs:
        if elapsed() > deadline_s:
            say(f"mfu: skipped micro-batch {micro_batch} x {micro_batches} ({checkpointing or 'no'} checkpointing): "
                f"{elapsed():.0f} s spent, past the {deadline_s:.0f} s set for starting one")
            continue
        attempt = checkpointing
        while True:
            try:
                r = mfu_run(sizes, device, micro_batch, micro_batches, attempt, peak.tflops, precision)
                break
            except torch.cuda.OutOfMemoryError as error:
                message = str(error).splitlines()[0][:200]
            # Out of the except block, so the traceback (and the model its frames hold) is gone before freeing.
            gc.collect()
            torch.cuda.empty_cache()
            say(f"mfu: out of memory at micro-batch {micro_batch} x {micro_batches} with "
                f"{attempt or 'no'} activation checkpointing: {message}")
            if attempt == "full":
                r = None
                break
            attempt = "full"
            say("mfu: retrying with full activation checkpointing")
        if r is None:
            continue
        runs.append(r)
        mfu_text = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        say(f"mfu: {r['params'] / 1e9:.3f}B params (built in {r['build_s']:.1f} s, placed in {r['place_s']:.1f} s); "
            f"micro-batch {micro_batch} x {micro_batches} x seq {sizes.seq} = {r['tokens_per_step']} tokens/step, "
            f"activation checkpointing {r['activation_checkpointing']}")
        say(f"mfu:   step {r['step_s_median']:.4f} s median ({r['step_s_min']:.4f}-{r['step_s_max']:.4f}, "
            f"{r['timed_steps']} steps); {r['tokens_per_s']:,.0f} tokens/s; {r['flops_per_token'] / 1e9:.3f} "
            f"GFLOP/token; {r['tflops']:.4g} TFLOP/s; MFU {mfu_text}; peak memory {r['peak_memory_gib']:.2f} GiB "
            f"({r['memory_kind']})")
        say("mfu:   losses " + " ".join(f"{x:.4f}" for x in r["losses"]))
    return runs, peak.describe()


# ---- main ----------------------------------------------------------------------------------------------------

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on CPU: exercises the code paths")
    parser.add_argument("--skip-exactness", action="store_true")
    parser.add_argument("--skip-mfu", action="store_true")
    parser.add_argument("--precision", default="mixed_precision", help="the MFU run's runtime precision policy")
    parser.add_argument("--budget-s", type=float, default=300.0,
                        help="no MFU run starts after this many seconds (the wrapper's hard limit is above it)")
    parser.add_argument("--json", default=None,
                        help="where to write the JSON summary (default: $OUT/device_check.json)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's own; 1 with --cpu-smoke, where more only contend on a "
                             "small shared machine)")
    parser.add_argument("--dp-worker", metavar="DIR", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--warn-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.dp_worker:
        dp_worker(args.dp_worker, args.cpu_smoke, args.warn_only)
        return 0

    smoke = args.cpu_smoke
    if args.threads or smoke:
        torch.set_num_threads(args.threads or 1)
    cuda_version = torch.version.cuda or "none (a CPU build)"
    say(f"device_check: torch {torch.__version__} (CUDA {cuda_version}), Python {platform.python_version()}, "
        f"{os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads")
    if not torch.cuda.is_available() and not smoke:
        say(f"device_check: FAIL: CUDA is not available (torch {torch.__version__}, built with CUDA {cuda_version}, "
            f"{torch.cuda.device_count()} devices): run it on a GPU machine, or pass --cpu-smoke")
        return 2
    if smoke:
        device, hardware, name = torch.device("cpu"), "cpu", platform.processor() or platform.machine()
        say(f"device_check: --cpu-smoke: CPU ({name}), tiny sizes; CUDA available: {torch.cuda.is_available()}")
    else:
        from runtime.device import _cuda_hardware  # the peak table's key for the card, as the trainer names it

        torch.cuda.set_device(0)
        device, name = torch.device("cuda", 0), torch.cuda.get_device_name(0)
        hardware = _cuda_hardware(0)
        props = torch.cuda.get_device_properties(0)
        say(f"device_check: {name} ({hardware}; {props.total_memory / 2**30:.1f} GiB, "
            f"{props.multi_processor_count} SMs, capability {props.major}.{props.minor}); "
            f"{torch.cuda.device_count()} CUDA device(s); peak table entry: "
            f"{PEAK_TFLOPS.get(hardware, 'none')} TFLOP/s")
    key = "smoke" if smoke else "gpu"
    summary = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
               "device": name, "hardware": hardware, "cpu_smoke": smoke, "tolerance_rtol": RTOL}
    ok = True
    if not args.skip_exactness:
        summary["exactness"], refs, exact_ok = exactness(EXACT[key], device, smoke)
        warn_only = any(r["deterministic_mode"] != "strict" for r in summary["exactness"].values())
        summary["two_process"], dp_ok = two_process(EXACT[key], refs, smoke, timeout_s=150 if smoke else 180,
                                                    warn_only=warn_only)
        summary["streamed_save"], save_ok = streamed_save(EXACT[key], device)
        ok = exact_ok and dp_ok and save_ok
        summary["exactness_passed"] = ok
        say(f"exactness: {'PASS' if ok else 'FAIL'} ({elapsed():.0f} s so far)")
    if not args.skip_mfu:
        summary["mfu"], summary["peak"] = mfu(MFU[key], device, hardware, args.precision, args.budget_s)
    summary["seconds"] = elapsed()
    summary["passed"] = ok
    say(f"device_check: {'PASS' if ok else 'FAIL'} in {elapsed():.0f} s")
    path = args.json or (os.path.join(os.environ["OUT"], "device_check.json") if os.environ.get("OUT") else None)
    if path:
        Path(path).write_text(json.dumps(summary, indent=1, default=str) + "\n")
        say(f"device_check: summary written to {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

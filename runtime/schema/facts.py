# Numbers the launcher and the runtime must agree on, each written once (issue 38, "one owner per fact"): the
# runtime's MFU and the estimator's time to train divide the same model FLOPs by the same peak; the estimator's
# bytes per element are the dtypes the runtime holds; a checkpointed stop ends with the exit code the job script
# and `nxdt-launch status` look for. Torch-free, like all of runtime/schema: the launcher imports it.
# tests/schema/test_one_owner.py checks that both sides read these objects and agree on the MFU.
from __future__ import annotations

import dataclasses

# Dense BF16 peak TFLOP/s per device (one torch device = one worker process), keyed by the names the device goes by
# everywhere: cluster.neuron.hardware (NXDT_NEURON_HARDWARE in the job script), runtime/device.py's Device.hardware
# and the estimator's --device.
#   trn1  a Trainium1 NeuronCore-v2: 190 per chip of two cores
#   trn2  a logical NeuronCore at LNC=2 (two physical NeuronCore-v3): 667 per chip of four logical cores
#   trn2-lnc1  a physical NeuronCore-v3 at LNC=1 (cluster.neuron.lnc=1): eight per chip
#   h100, h200  SXM
# A CPU has no row: its peak depends on the machine. The runtime computes it at start (runtime/metrics.py
# cpu_peak: /proc/cpuinfo's theory or a measured matmul, whichever is higher); the estimator, which runs
# elsewhere, assumes a figure (launcher/estimator/hardware.py CPU_ASSUMED_TFLOPS).
PEAK_TFLOPS: dict[str, float] = {
    "trn1": 190.0 / 2,
    "trn2": 667.0 / 4,
    "trn2-lnc1": 667.0 / 8,  # LNC=1: one physical NeuronCore-v3, eight per chip
    "h100": 989.0,
    "h200": 989.0,
}

# Bytes per element of the dtypes training holds tensors in, by the short names used below (fp16 is not
# supported: launcher/nemo_config.py refuses it).
DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2}


@dataclasses.dataclass(frozen=True)
class PrecisionPolicy:
    """What a training.precision.type means, with dtypes by name: runtime/precision.py maps them to torch dtypes
    (and its header says why each mode is so), the estimator to bytes. Gradients accumulate in fp32 and Adam's
    moments are fp32 in every mode."""

    param: str                  # the weights as the model holds them
    master_weights: bool        # a separate fp32 copy of the weights that the optimizer updates
    stochastic_rounding: bool   # fp32 -> bf16 weight writes round stochastically instead of to nearest
    autocast: str | None        # the forward runs under torch.autocast to this dtype

    @property
    def compute(self) -> str:
        """The dtype of matmul inputs and outputs."""
        return self.autocast or self.param


# Keyed by runtime/schema/choices.py PRECISION_TYPES.
PRECISION_POLICIES: dict[str, PrecisionPolicy] = {
    "fp32": PrecisionPolicy("fp32", False, False, None),
    "bf16SR": PrecisionPolicy("bf16", False, True, None),
    "mixed_precision": PrecisionPolicy("bf16", True, False, None),
    "mixed_precisionSR": PrecisionPolicy("bf16", True, True, None),
    "autocast": PrecisionPolicy("fp32", False, False, "bf16"),
}

# Host memory an asynchronous checkpoint holds besides the rank's state (runtime/checkpoint/staging.py): a ring the
# save streams the state through, kept for the run. The writer reads the saved step while the next step's forward and
# backward run; the next optimizer step, before it changes anything, brings what is not written yet into the ring
# and waits for the writer to get through the rest. Where the state is host memory already (CPU) the writer reads it
# in place and the ring only shortens that wait: 1/16 of what the rank saves, in whole chunks, at most 256 MiB (none
# at all: the step waits for the whole write). On an accelerator everything the writer reads passes through the
# ring, and the window it has before the update is shorter (on XLA the trace of the forward and backward, not their
# run): 1/4 of what the rank saves, at least one chunk, at most 2 GiB. On XLA, where only whole tensors transfer
# (data parallelism's flat buffers, 160 MB at most in fp32 at its default bucket size), a buffer larger than the
# ring passes alone.
CHECKPOINT_CHUNK_BYTES = 16 << 20   # a multiple of the rank file's checksum block (1 MiB)
CHECKPOINT_RING_FRACTION = 16
CHECKPOINT_RING_MAX_BYTES = 256 << 20
CHECKPOINT_DEVICE_RING_FRACTION = 4
CHECKPOINT_DEVICE_RING_MAX_BYTES = 2 << 30


def checkpoint_staging_bytes(saved_bytes: float, *, state_on_host: bool) -> int:
    """Host bytes an async save of `saved_bytes` holds besides the live state: the ring, sized for where the state
    lives (see above)."""
    fraction, most, least = ((CHECKPOINT_RING_FRACTION, CHECKPOINT_RING_MAX_BYTES, 0) if state_on_host else
                             (CHECKPOINT_DEVICE_RING_FRACTION, CHECKPOINT_DEVICE_RING_MAX_BYTES, CHECKPOINT_CHUNK_BYTES))
    ring = int(saved_bytes) // fraction // CHECKPOINT_CHUNK_BYTES * CHECKPOINT_CHUNK_BYTES
    return max(least, min(ring, most))


# "Temporary failure, try again" (sysexits.h EX_TEMPFAIL): training saved a checkpoint and stopped (runtime/
# preemption.py); the job script requeues on it, the launcher reports "stopped at a checkpoint".
PREEMPTED_EXIT_CODE = 75
# A mistake in the config (runtime/train.py): a restart would only repeat it, so the job script stops.
USER_ERROR_EXIT_CODE = 2
# A node failed its health or collective check (runtime/preflight.py): the job script checks every node.
PREFLIGHT_EXIT_CODE = 3


# FLOPs per token (model FLOPs, the convention behind MFU in the PaLM and Megatron papers):
#     6 * N  +  12 * L * q * T
# with q = heads * head_dim, the width of the queries and of the attention output (h itself unless the head size
# is set apart from hidden / heads, as Qwen3's model.kv_channels is; Megatron's query_projection_size).
# N counts the weights that take part in a matrix multiply per token: per layer the attention projections
# (h*(q + 2*kv) for q,k,v with kv = query_groups * head_dim, plus q*h for the output) and the MLP (2*h*ffn, or
# 3*h*ffn for a gated SwiGLU MLP), plus the output layer h*vocab; the input embedding is a lookup and is left
# out, as are biases and norms (q/k norms included). Each such weight costs 2 FLOPs per token forward and 4
# backward, hence 6N. The attention term: per layer and token, QK^T and the weighted sum of V are 2*T*q
# multiply-adds together = 4*T*q FLOPs forward, times 3 for forward + backward = 12*L*q*T (full, non-causal count,
# as PaLM does). Recomputation under activation checkpointing is not counted: MFU measures useful work. Of an MoE
# layer only what a token uses counts: its top_k experts' MLPs, each of model.moe.ffn_hidden_size hidden units
# (Qwen3-MoE's experts are much narrower than a dense MLP would be), and the router (hidden x num_experts).
def matmul_weights(
    num_layers: int,
    hidden_size: int,
    ffn_hidden_size: int,
    num_attention_heads: int,
    num_query_groups: int,
    vocab_size: int,
    gated_mlp: bool,
    moe_layers: int = 0,
    moe_top_k: int = 0,
    moe_num_experts: int = 0,
    head_dim: int | None = None,
    moe_ffn_hidden_size: int | None = None,
) -> int:
    """N above: the weights one token multiplies by, of `moe_layers` MoE layers only its top_k experts' and the
    router's. `head_dim`: the model's head size (ModelConfig.head_dim); None: hidden_size / num_attention_heads.
    `moe_ffn_hidden_size`: each expert's hidden units (MoEConfig.ffn_hidden_size); None: ffn_hidden_size."""
    d = _head_dim(hidden_size, num_attention_heads, head_dim)
    q_dim, kv_dim = num_attention_heads * d, num_query_groups * d
    attention = hidden_size * (q_dim + 2 * kv_dim) + q_dim * hidden_size
    matrices = 3 if gated_mlp else 2
    mlp = matrices * hidden_size * ffn_hidden_size
    expert = matrices * hidden_size * (moe_ffn_hidden_size or ffn_hidden_size)
    moe_mlp = moe_top_k * expert + hidden_size * moe_num_experts
    return (num_layers * attention + (num_layers - moe_layers) * mlp + moe_layers * moe_mlp
            + hidden_size * vocab_size)


def flops_per_token(
    num_layers: int,
    hidden_size: int,
    ffn_hidden_size: int,
    num_attention_heads: int,
    num_query_groups: int,
    vocab_size: int,
    seq_length: int,
    gated_mlp: bool,
    moe_layers: int = 0,
    moe_top_k: int = 0,
    moe_num_experts: int = 0,
    head_dim: int | None = None,
    moe_ffn_hidden_size: int | None = None,
) -> float:
    """Training FLOPs (forward + backward) per token: 6 * N + 12 * L * q * T, see above."""
    weights = matmul_weights(num_layers, hidden_size, ffn_hidden_size, num_attention_heads, num_query_groups,
                             vocab_size, gated_mlp, moe_layers, moe_top_k, moe_num_experts, head_dim,
                             moe_ffn_hidden_size)
    q_dim = num_attention_heads * _head_dim(hidden_size, num_attention_heads, head_dim)
    return 6.0 * weights + 12.0 * num_layers * q_dim * seq_length


def _head_dim(hidden_size: int, num_attention_heads: int, head_dim: int | None) -> int:
    # The default is ModelConfig.head_dim's for a model without kv_channels.
    return head_dim or hidden_size // num_attention_heads

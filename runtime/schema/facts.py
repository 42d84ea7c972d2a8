# Numbers the launcher and the runtime must agree on, each written once (issue 38, "one owner per fact"): the
# runtime's MFU and the estimator's time to train divide the same model FLOPs (runtime/schema/sizes.py) by the same
# peak; the estimator's bytes per element are the dtypes the runtime holds; a checkpointed stop ends with the exit
# code the job script and `nxdt-launch status` look for. Torch-free, like all of runtime/schema: the launcher imports it.
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

# fp32 bytes of optimizer state per parameter, by model.optim.name (runtime/parallel/optimizers.py keeps exactly
# these tensors; master weights are the precision's, counted apart): Adam's two moments; SGD's momentum buffer
# (none without momentum); schedule-free's z (and AdamW's second moment); Adafactor's row and column statistics,
# rows + columns per matrix, which round to 0 bytes per parameter for any weight of size.
OPTIMIZER_STATE_BYTES: dict[str, int] = {"adamw": 8, "adam": 8, "sgd": 4, "adafactor": 0, "adamw_schedulefree": 8,
                                         "sgd_schedulefree": 4}


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
# A user's mistake (bad input: a config, an option, a file), after one `error: ...` line per problem: the exit code of
# every entry point (nxdt-launch, each stage program, the python -m tools). A restart would only repeat it, so the
# job script stops (runtime/fault_tolerance/attempts.py).
USER_ERROR_EXIT_CODE = 2
# A node failed its health or collective check (runtime/preflight.py): the job script checks every node.
PREFLIGHT_EXIT_CODE = 3

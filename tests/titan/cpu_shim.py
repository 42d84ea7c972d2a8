"""A FAKE accelerator for torchtitan on CPU, for the tests only (production code never imports it).

torchtitan 0.3.0 as shipped trains only on an accelerator (CUDA; Neuron through its own plugin). Four things a
device and its collective library would supply are missing on a CPU with gloo, and this supplies exactly those:

1. The device: torchtitan.tools.utils picks "cuda" when torch sees no accelerator. The fake is "cpu" with a device
   module that answers torchtitan's memory questions (name, capacity, peak statistics) with zeros.
2. Attention with a backward: FlexAttention (torchtitan's default inner attention) has no CPU backward. The fake
   evaluates the same BlockMask's mask_mod densely (torch.nn.attention.flex_attention.create_mask) and runs
   scaled_dot_product_attention under that boolean mask: the same attention, with autograd's backward. Its
   BlockMask is made eagerly (torchtitan compiles create_block_mask, which takes tens of seconds on a CPU).
3. PREMUL_SUM: FSDP2 reduce-scatters gradients with ReduceOp.PREMUL_SUM(1 / factor) once torchtitan sets the
   divide factor to 1.0 (it normalizes by the global token count itself); gloo refuses the op. The fake makes
   FSDP use a plain SUM then (force_sum_reduction_for_comms), which for factor 1.0 is the same sum.
4. torch.distributed.set_timeout (torchtitan shortens process-group timeouts after the first step) is missing in
   torch 2.13: the fake sets the timeout on the group (ProcessGroup.set_timeout).

install() applies 1 and 2 when torchtitan's modules are first imported (an import hook), 3 and 4 at once.
tests/titan/shim_site/sitecustomize.py calls it in torchrun's workers when NXDT_TITAN_CPU_SHIM=1.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

_PATCHES = {}  # module name -> function applied right after the module is executed


class FakeDeviceModule(types.SimpleNamespace):
    """torch.cpu plus the memory questions torchtitan asks a CUDA-like device module (answered with zeros)."""

    def __init__(self):
        import torch

        super().__init__()
        self._cpu = torch.cpu

    def __getattr__(self, name):
        return getattr(self._cpu, name)

    def get_device_name(self, device=None) -> str:
        return "fake CPU device (tests/titan/cpu_shim.py)"

    def get_device_properties(self, device=None):
        return types.SimpleNamespace(total_memory=1 << 30, name=self.get_device_name())

    def memory_stats(self, device=None) -> dict:
        return {}

    def reset_peak_memory_stats(self, device=None) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def current_device(self) -> int:
        return 0


def _fake_device(module) -> None:
    module.device_type, module.device_module = "cpu", FakeDeviceModule()


def _dense_masked_attention(module) -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_block_mask, create_mask

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks, score_mod=None, scale=None, enable_gqa=False,
                out_transform=None, **kwargs):
        assert score_mod is None and out_transform is None, "the fake attention takes masks only"
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))  # (B, N, L, H)
        batch, _, q_len, _ = q.shape
        mask = create_mask(attention_masks.mask_mod, batch, None, q_len, k.shape[2], device=q.device)
        with torch.no_grad():
            mask = mask.bool()  # (B, 1, L, L): True where a query may attend to a key
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
        return out.transpose(1, 2)  # (B, L, N, H)

    module.FlexAttention.forward = forward
    # torchtitan compiles create_block_mask (tens of seconds on CPU); the fake only reads the mask's mask_mod.
    module.create_attention_mask = create_block_mask


def _sum_reduction_for_divide_factor_one() -> None:
    from torch.distributed.fsdp import FSDPModule

    original = FSDPModule.set_gradient_divide_factor

    def set_gradient_divide_factor(self, factor: float) -> None:
        original(self, factor)
        if factor == 1.0:
            self.set_force_sum_reduction_for_comms(True)

    FSDPModule.set_gradient_divide_factor = set_gradient_divide_factor


def _set_timeout() -> None:
    import torch.distributed as dist

    if hasattr(dist, "set_timeout"):
        return

    def set_timeout(timeout, group=None) -> None:
        (group or dist.distributed_c10d._get_default_group()).set_timeout(timeout)

    dist.set_timeout = set_timeout


class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Runs _PATCHES[name] on a module right after it is executed, whoever imports it first."""

    def find_spec(self, name, path, target=None):
        if name not in _PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        self._loaders = getattr(self, "_loaders", {})
        self._loaders[name] = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._loaders[spec.name].create_module(spec)

    def exec_module(self, module):
        self._loaders[module.__name__].exec_module(module)
        _PATCHES[module.__name__](module)


def install() -> None:
    """Apply the four fakes (idempotent)."""
    if any(isinstance(finder, _AfterImport) for finder in sys.meta_path):
        return
    _PATCHES["torchtitan.tools.utils"] = _fake_device
    _PATCHES["torchtitan.models.common.attention"] = _dense_masked_attention
    for name, patch in _PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])
    sys.meta_path.insert(0, _AfterImport())
    _sum_reduction_for_divide_factor_one()
    _set_timeout()

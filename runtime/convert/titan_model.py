# The model half of checkpoint conversion between our runtime and torchtitan (runtime/convert/titan.py): which of our
# models torchtitan 0.3.0 builds (llama3, qwen3 dense), its model config for ours, and our full state <-> torchtitan's
# model state dict. The key mapping is composed, not tabled: our names -> Hugging Face's (runtime/convert/hf.py) ->
# torchtitan's (its own state_dict_adapter, which also permutes q/k rows for its interleaved RoPE) -> the module's own
# load hook, which fuses q/k/v into `qkv_linear.wqkv`. Every step only reorders elements, so it is bitwise both ways.
# A parameter's optimizer state takes the same path (the model is loaded with it as its values), which gives the fused
# layout torchtitan's optimizer keeps for wqkv (its state dict hook splits weights on save; optimizer state is not).
from __future__ import annotations

import torch

from runtime.convert.hf import from_hf, to_hf
from runtime.convert.hf_layout import pad_vocab
from runtime.schema.families import TORCHTITAN_MODELS
from runtime.schema.model import ModelConfig
from runtime.titan.shape import titan_model, titan_shape

def titan_family(cfg: ModelConfig, where: str) -> str:
    """torchtitan's model for ours (runtime/titan/shape.py judges it); ValueError naming why there is none."""
    name, why = titan_model(cfg, p=f"{where}: model.")
    if name is None:
        raise ValueError(f"{why} (conversion to and from torchtitan covers "
                         f"{', '.join(TORCHTITAN_MODELS.values())}, dense)")
    return name


def titan_model_spec(cfg: ModelConfig, family: str, attn_backend: str = "flex"):
    """torchtitan's ModelSpec with our model's shape (runtime/titan/model.py, the one builder of it)."""
    from runtime.titan.model import model_spec

    shape = {k: v for k, v in titan_shape(cfg).items() if v is not None}
    return model_spec(family, **shape, attn_backend=attn_backend)


class TitanModel:
    """torchtitan's model for `cfg` on the CPU (fp32) and its state dict adapter: the keys both ways."""

    def __init__(self, cfg: ModelConfig, family: str):
        self.cfg, self.family = cfg, family
        spec = titan_model_spec(cfg, family)
        self.config = spec.model
        with torch.device("meta"):
            model = self.config.build()
        self.model = model.to_empty(device="cpu")
        self.adapter = spec.state_dict_adapter(self.config, None)

    def state_keys(self) -> dict[str, torch.Size]:
        """The model keys torchtitan's checkpoints hold (its state dict: q/k/v split) and their shapes."""
        return {k: v.shape for k, v in self.model.state_dict().items()}

    @torch.no_grad()
    def _load(self, state: dict[str, torch.Tensor]) -> None:
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        missing = [k for k in missing if k in self.state_keys()]
        if missing or unexpected:
            raise ValueError(f"the state does not match torchtitan's model: missing {missing[:3]}, unexpected "
                             f"{unexpected[:3]}")

    def from_ours(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Our full state (weights or one optimizer state key) -> torchtitan's stock names (q/k/v split)."""
        hf, _ = to_hf(full, self.cfg)
        return self.adapter.from_hf(hf)

    def to_ours(self, titan: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """torchtitan's stock names -> our full state, our vocabulary padding restored."""
        from runtime.convert.hf import _hf_config

        hf = self.adapter.to_hf(dict(titan))
        ours, _ = from_hf(hf, _hf_config(self.cfg.unpadded() if self.cfg.padding_from else self.cfg,
                                         next(iter(hf.values())).dtype))
        return pad_vocab(ours, self.cfg)

    def checkpoint_state(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Our weights -> the model keys of a torchtitan checkpoint (its ModelWrapper's state dict)."""
        self._load(self.from_ours(full))
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def parameter_state(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One of our optimizer state keys (full tensors) -> torchtitan's per-parameter layout, by parameter name
        (wqkv fused as its optimizer holds it)."""
        self._load(self.from_ours(full))
        return {name: p.detach().clone() for name, p in self.model.named_parameters()}

    def from_parameter_state(self, by_param: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The inverse of parameter_state: torchtitan's per-parameter tensors -> our full state."""
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                param.copy_(by_param[name])
        return self.to_ours({k: v.detach().clone() for k, v in self.model.state_dict().items()})  # not views

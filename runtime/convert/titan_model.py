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
from runtime.schema.families import export_family
from runtime.schema.model import ModelConfig

FAMILIES = ("llama3", "qwen3")


def titan_family(cfg: ModelConfig, where: str) -> str:
    """llama3 or qwen3 for a model torchtitan builds exactly; ValueError naming what is not (contract 4, TITAN.md)."""
    try:
        name = export_family(cfg).__name__.rsplit(".", 1)[-1]
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
    scaling = cfg.rope_scaling.rope_type if cfg.rope_scaling is not None else None
    if name == "llama" and scaling in (None, "llama3") and cfg.kv_channels in (None, cfg.head_dim):
        return "llama3"
    if name == "qwen3" and scaling is None:
        return "qwen3"
    raise ValueError(f"{where}: a {name} model{f' with rope_scaling {scaling}' if scaling else ''} is not one "
                     f"torchtitan's families here build; conversion to and from torchtitan covers {', '.join(FAMILIES)}"
                     f" (dense)")


def titan_model_config(cfg: ModelConfig, family: str, attn_backend: str = "flex"):
    """torchtitan's model config with our model's shapes, built by its own layer builders (those of its registry's
    flavors), RMSNorm eps set to ours (its builders fix it per family)."""
    from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear, RMSNorm

    vocab = cfg.padding_from or cfg.vocab_size  # the source's rows: torchtitan does not pad the vocabulary
    shape = dict(n_layers=cfg.num_layers, dim=cfg.hidden_size, n_heads=cfg.num_attention_heads,
                 n_kv_heads=cfg.kv_heads, hidden_dim=cfg.ffn_hidden_size, attn_backend=attn_backend)
    rope = dict(dim=cfg.head_dim, max_seq_len=cfg.max_position_embeddings, theta=cfg.rotary_base)
    if family == "llama3":
        from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers

        scaling = cfg.rope_scaling
        if scaling is not None:  # Llama 3.1's, with Hugging Face's keys
            rope.update(scaling="llama", scaling_factor=scaling.factor, low_freq_factor=scaling.low_freq_factor,
                        high_freq_factor=scaling.high_freq_factor,
                        original_max_position_embeddings=scaling.original_max_position_embeddings)
        layers, model = _build_llama3_layers(**shape, rope=ComplexRoPE.Config(**rope)), Llama3Model
    else:
        from torchtitan.models.qwen3 import Qwen3Model, _build_qwen3_layers

        layers = _build_qwen3_layers(**shape, head_dim=cfg.head_dim, rope=CosSinRoPE.Config(**rope))
        model = Qwen3Model
    config = model.Config(
        dim=cfg.hidden_size, vocab_size=vocab, enable_weight_tying=cfg.share_embeddings_and_output_weights,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=cfg.hidden_size),
        norm=RMSNorm.Config(normalized_shape=cfg.hidden_size),
        lm_head=Linear.Config(in_features=cfg.hidden_size, out_features=vocab), layers=layers)
    _set_eps(config, cfg.layernorm_epsilon, RMSNorm.Config, set())
    return config


def _set_eps(node, eps: float, norm_type: type, seen: set) -> None:
    if id(node) in seen:
        return
    seen.add(id(node))
    if isinstance(node, norm_type):
        node.eps = eps
    elif isinstance(node, (list, tuple)):
        for item in node:
            _set_eps(item, eps, norm_type, seen)
    elif hasattr(node, "__dataclass_fields__"):
        for name in node.__dataclass_fields__:
            _set_eps(getattr(node, name, None), eps, norm_type, seen)


class TitanModel:
    """torchtitan's model for `cfg` on the CPU (fp32) and its state dict adapter: the keys both ways."""

    def __init__(self, cfg: ModelConfig, family: str):
        from torchtitan.models.llama3 import Llama3StateDictAdapter
        from torchtitan.models.qwen3 import Qwen3StateDictAdapter

        self.cfg, self.family = cfg, family
        self.config = titan_model_config(cfg, family)
        with torch.device("meta"):
            model = self.config.build()
        self.model = model.to_empty(device="cpu")
        adapter = Llama3StateDictAdapter if family == "llama3" else Qwen3StateDictAdapter
        self.adapter = adapter(self.config, None)

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

# Conversion between the runtime's full (unsharded) state dict and Hugging Face GPT2LMHeadModel /
# LlamaForCausalLM / MixtralForCausalLM checkpoints: export a trained model to HF tools, or start training from an
# HF model. Mixtral is written under the names transformers saves on disk (`block_sparse_moe.experts.{e}.w1`, ...),
# which every transformers version loads; 5.x's fused in-memory names (`mlp.experts.gate_up_proj`) import too.
# Only renames, transposes, splits and concatenations touch the tensors (no arithmetic, no dtype change), so a
# round trip is bitwise lossless. transformers is deliberately not imported: only its file format is needed.
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from runtime.io.files import replace_directory
from runtime.schema.model import MoEConfig, ModelConfig, hf_model_keys, tokenizer_vocab_size
from runtime.schema.safetensors_file import hf_weights_problems
from runtime.models import meta_model

# Our GeluMLP uses the tanh approximation; HF spells that two ways with identical math.
_SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size ("5GB")


@dataclasses.dataclass(frozen=True)
class _Rule:
    """One of our tensors and the HF tensor(s) holding the same values."""

    ours: str
    hf: tuple[str, ...]           # several names: our fused weight is their row-wise concatenation, in order
    rows: tuple[int, ...] = ()    # the parts' row counts when len(hf) > 1
    transpose: bool = False       # GPT-2's Conv1D stores (in, out), the transpose of nn.Linear
    experts: int = 0              # ours stacks this many per-expert matrices on dim 0; HF stores each expert's
                                  # parts separately, expert by expert (rows and transpose apply per expert)


def _rules(cfg: ModelConfig) -> list[_Rule]:
    tied = cfg.share_embeddings_and_output_weights
    if cfg.architecture == "gpt":
        rules = [_Rule("embed.word.weight", ("transformer.wte.weight",)),
                 _Rule("embed.position.weight", ("transformer.wpe.weight",))]
        for i in range(cfg.num_layers):
            o, h = f"layers.{i}.", f"transformer.h.{i}."
            for ours, hf, linear in [("attn_norm", "ln_1", False), ("mlp_norm", "ln_2", False),
                                     ("attn.qkv", "attn.c_attn", True), ("attn.proj", "attn.c_proj", True),
                                     ("mlp.fc1", "mlp.c_fc", True), ("mlp.fc2", "mlp.c_proj", True)]:
                rules += [_Rule(o + ours + ".weight", (h + hf + ".weight",), transpose=linear),
                          _Rule(o + ours + ".bias", (h + hf + ".bias",))]
        rules += [_Rule("final_norm.weight", ("transformer.ln_f.weight",)),
                  _Rule("final_norm.bias", ("transformer.ln_f.bias",))]
    else:
        # Our qkv rows are [Q (nh*d) | K (ng*d) | V (ng*d)] blocks, not interleaved per head, and both sides
        # apply RoPE in the rotate-half layout, so q/k need no permutation.
        qkv_rows = (cfg.num_attention_heads * cfg.head_dim,) + (cfg.kv_heads * cfg.head_dim,) * 2
        rules = [_Rule("embed.word.weight", ("model.embed_tokens.weight",))]
        for i in range(cfg.num_layers):
            o, h = f"layers.{i}.", f"model.layers.{i}."
            rules += [
                _Rule(o + "attn_norm.weight", (h + "input_layernorm.weight",)),
                _Rule(o + "attn.qkv.weight", tuple(h + f"self_attn.{p}_proj.weight" for p in "qkv"), qkv_rows),
                _Rule(o + "attn.proj.weight", (h + "self_attn.o_proj.weight",)),
                _Rule(o + "mlp_norm.weight", (h + "post_attention_layernorm.weight",))]
            rules += _moe_rules(cfg, o, h) if cfg.moe and cfg.moe.is_moe_layer(i) else [
                _Rule(o + "mlp.gate_up.weight", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"),
                      (cfg.ffn_hidden_size,) * 2),
                _Rule(o + "mlp.down.weight", (h + "mlp.down_proj.weight",))]
        rules.append(_Rule("final_norm.weight", ("model.norm.weight",)))
    if not tied:
        rules.append(_Rule("output.weight", ("lm_head.weight",)))
    return rules


def _moe_rules(cfg: ModelConfig, o: str, h: str) -> list[_Rule]:
    """Our SparseMoE (router (E, H), gate_up (E, H, 2F) used as x @ gate_up[e], down (E, F, H)) as Mixtral's
    nn.Linear weights per expert: w1 = gate (F, H), w3 = up (F, H), w2 = down (H, F)."""
    m, experts, ffn = h + "block_sparse_moe.", cfg.moe.num_experts, cfg.ffn_hidden_size
    return [_Rule(o + "mlp.router.weight", (m + "gate.weight",)),
            _Rule(o + "mlp.gate_up", tuple(f"{m}experts.{e}.w{w}.weight" for e in range(experts) for w in (1, 3)),
                  (ffn, ffn), transpose=True, experts=experts),
            _Rule(o + "mlp.down", tuple(f"{m}experts.{e}.w2.weight" for e in range(experts)), transpose=True,
                  experts=experts)]


def _split(rule: _Rule, tensor: torch.Tensor) -> list[torch.Tensor]:
    """Our tensor -> its HF tensors in rule.hf's order, as views: per expert, transposed, then split by rows."""
    parts = []
    for matrix in tensor.unbind(0) if rule.experts else (tensor,):
        matrix = matrix.t() if rule.transpose else matrix
        parts += matrix.split(list(rule.rows)) if rule.rows else [matrix]
    return parts


def _join(rule: _Rule, parts: list[torch.Tensor]) -> torch.Tensor:
    """The inverse of _split: HF tensors in rule.hf's order -> our (contiguous unless a plain rename) tensor."""
    per_matrix = len(rule.rows) or 1
    matrices = []
    for start in range(0, len(parts), per_matrix):
        group = parts[start:start + per_matrix]
        matrix = torch.cat(group) if len(group) > 1 else group[0]
        matrices.append(matrix.t().contiguous() if rule.transpose else matrix)
    return torch.stack(matrices) if rule.experts else matrices[0]


def state_shapes(cfg: ModelConfig) -> dict[str, torch.Size]:
    """Every full-state name and shape, from a model on the meta device (no memory, no init)."""
    return {name: tensor.shape for name, tensor in meta_model(cfg).state_dict().items()}


def _hf_shapes(rule: _Rule, shape: torch.Size) -> list[torch.Size]:
    return [part.shape for part in _split(rule, torch.empty(shape, device="meta"))]  # one owner of the layout


def _own(tensor: torch.Tensor) -> torch.Tensor:
    """Contiguous and alone in its storage: safetensors refuses tensors that share memory (split views)."""
    exclusive = tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    return tensor if tensor.is_contiguous() and exclusive else tensor.clone(memory_format=torch.contiguous_format)


def to_hf(full_state: dict[str, torch.Tensor], cfg: ModelConfig) -> tuple[dict[str, torch.Tensor], dict]:
    """Our full state -> (HF state dict, config.json dict). Tied models store the embedding once."""
    if cfg.architecture == "gpt" and cfg.kv_heads != cfg.num_attention_heads:
        raise ValueError(f"model.num_query_groups={cfg.num_query_groups}: GPT2LMHeadModel has no grouped-query "
                         f"attention; only num_query_groups = num_attention_heads ({cfg.num_attention_heads}) "
                         "or null can be exported")
    if cfg.moe is not None:
        _check_mixtral(cfg.moe)
    shapes, state = state_shapes(cfg), dict(full_state)
    tied = cfg.share_embeddings_and_output_weights
    output = state.pop("output.weight", None) if tied else None  # a tied model may list it or not
    if tied:
        del shapes["output.weight"]
    _check_names(state, shapes, "full state")
    for name, shape in shapes.items():
        if state[name].shape != shape:
            raise ValueError(f"full state {name} has shape {tuple(state[name].shape)}; the model config implies "
                             f"{tuple(shape)}")
    embedding = state["embed.word.weight"]
    if output is not None and output is not embedding and not torch.equal(output, embedding):
        raise ValueError("full state output.weight differs from embed.word.weight although "
                         "model.share_embeddings_and_output_weights is true")
    hf: dict[str, torch.Tensor] = {}
    for rule in _rules(cfg):
        hf.update({name: _own(part) for name, part in zip(rule.hf, _split(rule, state[rule.ours]), strict=True)})
    return hf, _hf_config(cfg, embedding.dtype)


def _check_mixtral(moe: MoEConfig) -> None:
    """MixtralForCausalLM computes one MoE variant; refuse the others rather than export a model that transformers
    would run differently. The router's z-loss coefficient is not refused: it only shapes training, as dropout."""
    refusals = [
        (moe.frequency != 1, f"model.moe.frequency={moe.frequency}: MixtralForCausalLM has an MoE block in every "
                             "layer; only frequency 1 can be exported"),
        (moe.router_activation != "softmax", f"model.moe.router_activation={moe.router_activation!r}: Mixtral's "
                                             "router is a softmax; only softmax can be exported"),
        (not moe.normalize_top_k_affinities, "model.moe.normalize_top_k_affinities=false: Mixtral always "
                                             "renormalizes the top_k weights; only true can be exported"),
        (moe.capacity_factor is not None, f"model.moe.capacity_factor={moe.capacity_factor}: MixtralForCausalLM is "
                                          "dropless, so transformers would compute this model without dropping "
                                          "tokens; export with model.moe.dropless=true (capacity_factor null) to "
                                          "accept that difference"),
    ]
    for refused, message in refusals:
        if refused:
            raise ValueError(message)


def _hf_config(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    common = {"vocab_size": cfg.vocab_size,  # the padded size: the logits must keep their shape
              "tie_word_embeddings": cfg.share_embeddings_and_output_weights, "initializer_range": cfg.init_method_std,
              "bos_token_id": None, "eos_token_id": None,  # save_hf_directory fills these from the tokenizer
              "torch_dtype": str(dtype).removeprefix("torch.")}
    if cfg.architecture == "gpt":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": cfg.hidden_size,
                "n_layer": cfg.num_layers, "n_head": cfg.num_attention_heads, "n_inner": cfg.ffn_hidden_size,
                "n_positions": cfg.max_position_embeddings, "layer_norm_epsilon": cfg.layernorm_epsilon,
                "activation_function": "gelu_new", "resid_pdrop": cfg.hidden_dropout,
                "embd_pdrop": cfg.hidden_dropout, "attn_pdrop": cfg.attention_dropout, "scale_attn_weights": True,
                "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False, **common}
    llama = {"hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size,
             "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
             "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
             "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.layernorm_epsilon,
             "rope_theta": cfg.rotary_base, "attention_dropout": cfg.attention_dropout, **common}
    if cfg.moe is None:
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
                "mlp_bias": False, **llama}
    # output_router_logits false: transformers adds the load-balancing loss only when it is true, but the
    # coefficient is kept so that fine-tuning in transformers can switch it on with the value this model used.
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "num_local_experts": cfg.moe.num_experts, "num_experts_per_tok": cfg.moe.top_k,
            "router_aux_loss_coef": cfg.moe.router_aux_loss_coef, "output_router_logits": False,
            "router_jitter_noise": 0.0, "sliding_window": None, **llama}


def from_hf(hf_state: dict[str, torch.Tensor], hf_config: dict, *,
            tokenizer_vocab_size: int | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """HF state dict + config.json dict -> (our full state, the `model:` keys that rebuild the model).

    The keys give `ModelConfig.from_model_section(keys, tokenizer_vocab_size)` exactly HF's vocab_size: their
    make_vocab_size_divisible_by pads the tokenizer's size (when known; else HF's vocab_size) up to it.
    """
    keys = hf_model_keys(hf_config, tokenizer_vocab_size)
    vocab = int(hf_config["vocab_size"])
    cfg = ModelConfig.from_model_section(keys, tokenizer_vocab_size or vocab)
    assert cfg.vocab_size == vocab, (cfg.vocab_size, vocab)
    state = _normalized_hf_state(hf_state, hf_config["model_type"], cfg.share_embeddings_and_output_weights)
    rules, shapes = _rules(cfg), state_shapes(cfg)
    _check_names(state, {name: None for rule in rules for name in rule.hf}, "HF state")
    ours: dict[str, torch.Tensor] = {}
    for rule in rules:
        for name, shape in zip(rule.hf, _hf_shapes(rule, shapes[rule.ours]), strict=True):
            if state[name].shape != shape:
                raise ValueError(f"HF tensor {name} has shape {tuple(state[name].shape)}; config.json implies "
                                 f"{tuple(shape)}")
        ours[rule.ours] = _join(rule, [state[name] for name in rule.hf])
    if cfg.share_embeddings_and_output_weights:
        ours["output.weight"] = ours["embed.word.weight"]  # as build_model(cfg).state_dict() names it
    return ours, keys


def _normalized_hf_state(hf_state: dict[str, torch.Tensor], model_type: str, tied: bool) -> dict[str, torch.Tensor]:
    """Names as transformers 4.x/5.x save them: drops non-parameter buffers and a tied lm_head copy."""
    state = dict(hf_state)
    if model_type == "gpt2":
        if "transformer.wte.weight" not in state:  # OpenAI's original GPT-2 files lack the prefix
            state = {(k if k == "lm_head.weight" else "transformer." + k): v for k, v in state.items()}
        buffer = re.compile(r"transformer\.h\.\d+\.attn\.(bias|masked_bias)$")  # old causal-mask buffers
    else:
        buffer = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")
    state = {k: v for k, v in state.items() if not buffer.match(k)}
    if model_type == "mixtral":
        state = _legacy_mixtral_names(state)
    embedding = state.get("transformer.wte.weight" if model_type == "gpt2" else "model.embed_tokens.weight")
    if tied and "lm_head.weight" in state and embedding is not None:
        if not torch.equal(state.pop("lm_head.weight"), embedding):
            raise ValueError("lm_head.weight differs from the token embedding although config.json "
                             "tie_word_embeddings is true")
    return state


def _legacy_mixtral_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5.x's fused names (save_original_format=False) -> the per-expert names our rules use:
    mlp.gate.weight is the router; mlp.experts.gate_up_proj (E, 2F, H) holds [w1 | w3] rows per expert and
    mlp.experts.down_proj (E, H, F) holds w2 per expert."""
    fused = re.compile(r"(model\.layers\.\d+\.)mlp\.(gate\.weight|experts\.gate_up_proj|experts\.down_proj)$")
    out = {}
    for name, tensor in state.items():
        match = fused.match(name)
        if match is None:
            out[name] = tensor
            continue
        m = match.group(1) + "block_sparse_moe."
        if match.group(2) == "gate.weight":
            out[m + "gate.weight"] = tensor
        elif match.group(2) == "experts.down_proj":
            out.update({f"{m}experts.{e}.w2.weight": matrix for e, matrix in enumerate(tensor.unbind(0))})
        else:
            for e, matrix in enumerate(tensor.unbind(0)):
                gate, up = matrix.chunk(2)
                out.update({f"{m}experts.{e}.w1.weight": gate, f"{m}experts.{e}.w3.weight": up})
    return out


def _check_names(state: dict, expected: dict, what: str) -> None:
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{what} does not match the model config: missing {missing[:5]} "
                         f"({len(missing)} in all), unexpected {unexpected[:5]} ({len(unexpected)} in all)")


# ---- Directories: config.json, safetensors (sharded like transformers), tokenizer files ----

_SPECIAL_TOKENS = {  # the first of each that the tokenizer has; GPT-2 uses <|endoftext|> for bos and eos
    "bos_token": ("<s>", "<|begin_of_text|>", "<bos>", "<|endoftext|>"),
    "eos_token": ("</s>", "<|end_of_text|>", "<eos>", "<|endoftext|>"),
    "unk_token": ("<unk>",),
    "pad_token": ("<pad>", "<|pad|>"),
}


def save_hf_directory(out_dir: str | os.PathLike, full_state: dict[str, torch.Tensor], cfg: ModelConfig,
                      tokenizer_path: str | None, *, overwrite: bool = False,
                      max_shard_bytes: int = _SHARD_BYTES, also: Callable[[Path], None] | None = None) -> Path:
    """Write a directory `from_pretrained` loads. It appears whole or not at all (written beside, then renamed);
    `also(directory)` adds more files to it before it appears."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out_dir {str(out)!r} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"out_dir {str(out)!r} is not empty; pass overwrite=True to replace it")
    hf_state, config = to_hf(full_state, cfg)
    tokenizer = _read_json(Path(tokenizer_path), "tokenizer_path") if tokenizer_path else None
    specials = _special_tokens(tokenizer) if tokenizer else {}
    for key, token in specials.items():
        if key in ("bos_token", "eos_token", "pad_token"):
            config[key + "_id"] = _token_id(tokenizer, token)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide the model from everyone else on a shared filesystem
        _write_json(tmp / "config.json", config)
        _write_weights(tmp, hf_state, max_shard_bytes)
        if tokenizer_path:
            shutil.copyfile(tokenizer_path, tmp / "tokenizer.json")
            _write_json(tmp / "tokenizer_config.json", {
                "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.max_position_embeddings,
                "clean_up_tokenization_spaces": False, **specials})
            ids = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}
            if ids:
                _write_json(tmp / "generation_config.json", ids)
        if also is not None:
            also(tmp)
        replace_directory(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _write_weights(directory: Path, state: dict[str, torch.Tensor], max_shard_bytes: int) -> None:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    metadata = {"format": "pt"}  # transformers checks for it
    if len(shards) == 1:
        save_file(shards[0], directory / "model.safetensors", metadata=metadata)
        return
    weight_map = {}
    for index, shard in enumerate(shards, start=1):
        file = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, directory / file, metadata=metadata)
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in state.values())
    _write_json(directory / "model.safetensors.index.json", {"metadata": {"total_size": total},
                                                             "weight_map": weight_map})


def _special_tokens(tokenizer: dict) -> dict[str, str]:
    known = {entry["content"] for entry in tokenizer.get("added_tokens", [])}
    vocab = (tokenizer.get("model") or {}).get("vocab") or {}
    known |= set(vocab) if isinstance(vocab, dict) else {piece for piece, _ in vocab}  # Unigram: [piece, score]
    found = {key: next((t for t in names if t in known), None) for key, names in _SPECIAL_TOKENS.items()}
    return {key: token for key, token in found.items() if token is not None}


def _token_id(tokenizer: dict, token: str) -> int:
    for entry in tokenizer.get("added_tokens", []):
        if entry["content"] == token:
            return int(entry["id"])
    vocab = tokenizer["model"]["vocab"]
    return int(vocab[token]) if isinstance(vocab, dict) else [piece for piece, _ in vocab].index(token)


def load_hf_directory(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict, str | None]:
    """An HF model directory -> (our full state, our `model:` keys, its tokenizer.json or None)."""
    directory = Path(path)
    if not directory.is_dir():
        raise ValueError(f"{str(directory)!r} is not a directory (expected a Hugging Face model directory)")
    config = _read_json(directory / "config.json", "config.json")
    tokenizer = directory / "tokenizer.json"
    tokenizer_vocab = tokenizer_vocab_size(tokenizer) if tokenizer.is_file() else None
    state, keys = from_hf(_read_weights(directory), config, tokenizer_vocab_size=tokenizer_vocab)
    return state, keys, str(tokenizer) if tokenizer.is_file() else None


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """model.safetensors, a sharded safetensors index, or the older pytorch_model.bin (single or sharded)."""
    problems = hf_weights_problems(directory)  # headers only, before any tensor is read
    if problems:
        raise ValueError(f"{problems[0]}; re-download it or use a complete copy")

    def safetensors_load(file: Path) -> dict[str, torch.Tensor]:
        try:
            return load_file(file)
        except SafetensorError as error:  # what the header check cannot see (the file changed since, say)
            raise ValueError(f"{file}: not a readable safetensors file ({error})") from None

    def torch_load(file: Path) -> dict[str, torch.Tensor]:
        return torch.load(file, map_location="cpu", weights_only=True)

    for single, index, load in [("model.safetensors", "model.safetensors.index.json", safetensors_load),
                                ("pytorch_model.bin", "pytorch_model.bin.index.json", torch_load)]:
        if (directory / single).is_file():
            return load(directory / single)
        if (directory / index).is_file():
            weight_map = _read_json(directory / index, index).get("weight_map", {})
            state: dict[str, torch.Tensor] = {}
            for file in sorted(set(weight_map.values())):
                state.update(load(directory / file))
            return state
    raise ValueError(f"{str(directory)!r} has no weights: expected model.safetensors, "
                     "model.safetensors.index.json, pytorch_model.bin or pytorch_model.bin.index.json")


def _read_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{what}: {str(path)!r} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{what}: {str(path)!r} is not valid JSON ({error})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what}: {str(path)!r} does not hold a JSON object")
    return data


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")

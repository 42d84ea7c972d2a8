"""Tiny models and a training loop shared by the single-process references and the distributed ranks."""
from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from runtime.device import flash_attention_kernels
from runtime.models import ModelConfig, build_model
from runtime.models.lora import apply_lora
from runtime.models.moe import SparseMoE
from runtime.parallel import collectives as C
from runtime.parallel import (DataParallelConfig, ParallelDims, ShardedAdamW, Topology, gather_full_state_dict,
                              parallelize_model)
from runtime.parallel.context import sequence_index
from runtime.schema import rules
from runtime.schema.model import MoEConfig, RopeScaling
from runtime.schema.training_config import LoraConfig
from runtime.step import eval_objective, train_step

SEQ = 16
GLOBAL_BATCH = 8
MICRO_BATCH = 2
# eps 1e-6 rather than 1e-8: some gradients are mathematically zero (a GPT key bias shifts every score of a row
# equally, which softmax ignores), so they are pure float noise, and Adam divides noise by noise. A larger eps
# bounds that amplification so parameter comparisons measure the sharding, not rounding.
OPTIM = {"lr": 1e-3, "weight_decay": 0.1, "betas": [0.9, 0.95], "eps": 1e-6}

# Small gradient buckets: the tiny models' gradients reduce in many buckets, which start during backward as their
# parameters' last gradients land (runtime/parallel/data_parallel.py), so every layout runs the overlapped path.
BUCKET_NUMEL = 2048
# Optimizer steps per run: Adam's moments and ZeRO-1's sharded state, written by the first update, are read and
# rewritten by the two after it, and every reference run here ends below its first loss (assert_learns; the LoRA
# ones by their adapters). Each step is most of a layout's cost (about 4/5 of a forked rank's CPU), so no more.
STEPS = 3

TINY = {
    "gpt": dict(architecture="gpt", vocab_size=128, hidden_size=32, num_layers=2, num_attention_heads=4,
                ffn_hidden_size=64, max_position_embeddings=SEQ, share_embeddings_and_output_weights=True),
    "llama": dict(architecture="llama", vocab_size=128, hidden_size=32, num_layers=2, num_attention_heads=4,
                  num_query_groups=2, ffn_hidden_size=48, max_position_embeddings=SEQ, rotary_base=10000.0),
    # Gemma 3 (runtime/families/gemma3): a head size of its own (12), its softmax scale, a window of 5 of the 16
    # positions on layers 0, 1 and 3, the full layer's RoPE scaled (linear) and the local ones' base apart.
    "gemma3": dict(architecture="gemma3", vocab_size=128, hidden_size=32, num_layers=4, num_attention_heads=4,
                   num_query_groups=2, ffn_hidden_size=48, max_position_embeddings=SEQ, kv_channels=12,
                   rotary_base=1e6, rope_scaling=RopeScaling("linear", 8.0), local_rotary_base=10000.0,
                   softmax_scale=20 ** -0.5, sliding_window=5, share_embeddings_and_output_weights=True,
                   layer_types=("sliding_attention", "sliding_attention", "full_attention", "sliding_attention")),
}


# Every switch of the Llama decoder that the Llama 3.1+ and Qwen families turn on, in one model (tests/convert/
# test_hf_families.py holds each against transformers): Qwen3's per-head q/k norms and a head size (12) that is not
# hidden / heads (8), Qwen2's q/k/v biases, and Llama 3.1's RoPE scaling with an original context (4) short enough
# that the scaled frequencies reach the 16 positions trained on.
FAMILY_SWITCHES = dict(kv_channels=12, add_qkv_bias=True, qk_layernorm=True,
                       rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 4))
# Qwen3-MoE's block on Qwen3's attention: experts of their own size (24, the dense MLP's 48), top_k weights left
# unnormalized, and only layer 1 sparse (mlp_only_layers).
QWEN3_MOE = dict(kv_channels=12, qk_layernorm=True,
                 moe=MoEConfig(num_experts=4, top_k=2, normalize_top_k_affinities=False, ffn_hidden_size=24,
                               layers=(1,), router_aux_loss_coef=0.02))

# GPT-OSS (runtime/families/gpt_oss) on the Llama tiny shape: sinks and q/k/v/o biases, a head size of its own
# (12), layer 0 sliding (a window of 4 of the 16 positions), YaRN with an original context of 4, and every layer a
# MoE block with router and expert biases and the clamped SwiGLU.
GPT_OSS = dict(architecture="gpt_oss", kv_channels=12, sliding_window=4,
               layer_types=("sliding_attention", "full_attention"),
               rope_scaling=RopeScaling("yarn", 4.0, original_max_position_embeddings=4),
               moe=MoEConfig(num_experts=4, top_k=2, router_aux_loss_coef=0.02))


@dataclasses.dataclass(frozen=True)
class Layout:
    tp: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    zero1: bool = False
    zero_stage: int | None = None  # DataParallelConfig.zero_stage (2: ZeRO-2); None: from zero1
    activation_checkpointing: str | None = None
    recompute_modules: tuple[str, ...] = ("core_attention",)
    precision: str = "fp32"
    ep: int = 1
    cp: int = 1        # context parallelism (ring attention); like ep, carved out of the dp ranks below...
    ulysses: int = 1   # ...or Ulysses. Unlike ep, `dp` here counts distinct samples (Megatron's dp): the world
                       # is tp x dp x cp x ulysses (x pp in the pipeline tests).
    shard_degree: int | None = None  # hybrid sharding: ZeRO's shard group size (None: all of dp)

    @property
    def context(self) -> int:
        return self.cp * self.ulysses

    @property
    def context_kind(self) -> str:
        return "ulysses" if self.ulysses > 1 else "ring"


def tiny_config(arch: str, **overrides) -> ModelConfig:
    return ModelConfig(**{**TINY[arch], **overrides})


def global_batch(vocab: int, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fresh (GLOBAL_BATCH, SEQ) batch per step of learnable sequences (each token is a fixed function of the
    previous one, from a random start); the mask drops a different number of tokens per sample so micro-batches
    carry unequal token counts (which is what makes loss normalization matter)."""
    gen = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, vocab, (GLOBAL_BATCH, 1), generator=gen)
    tokens = (start * 5 ** torch.arange(SEQ + 1) + 3 * torch.arange(SEQ + 1)) % vocab  # (GLOBAL_BATCH, SEQ + 1)
    mask = torch.ones(GLOBAL_BATCH, SEQ)
    for row in range(GLOBAL_BATCH):
        mask[row, SEQ - row:] = 0.0  # row r loses its last r tokens
    return tokens[:, :-1], tokens[:, 1:], mask


def packed_positions(rows: int, seq: int = SEQ) -> torch.Tensor:
    """Fine-tuning's packed rows: positions restarting at 0 at each example (row r holds examples of lengths
    3 + r % 4, then 5, then the rest), which resets attention there (runtime.models.layers.SequenceLayout)."""
    positions = []
    for row in range(rows):
        lengths, left = [], seq
        for length in (3 + row % 4, 5):
            lengths.append(min(length, left))
            left -= lengths[-1]
        lengths.append(left)
        positions.append(torch.cat([torch.arange(n) for n in lengths if n]))
    return torch.stack(positions)


def micro_batches_for(step: int, vocab: int, topo: Topology, context_kind: str = "ring", packed: bool = False,
                      documents: bool = False):
    """This DP rank's share of the step's global batch, cut into micro-batches; under a context group, only the
    rank's tokens of each sample (the data loader's job in training). packed: fine-tuning rows, with position ids
    and the loss on each example's second half only (its "assistant" tokens). documents: pretraining rows with
    separated documents (model.data.reset_attention_mask), laid out as packed_positions says; under a context group
    the rank keeps its tokens and the whole row's positions, as runtime/data/loader.py hands them over."""
    input_ids, labels, mask = global_batch(vocab, step)
    if packed:
        positions = packed_positions(GLOBAL_BATCH)
        mask = mask * (positions % 2 == 1)  # a loss mask that is not the padding mask
        per_rank = GLOBAL_BATCH // topo.data_size
        rows = slice(topo.data_rank * per_rank, (topo.data_rank + 1) * per_rank)
        fields = [t[rows] for t in (input_ids, labels, mask, positions)]
        return [tuple(t[i:i + MICRO_BATCH] for t in fields) for i in range(0, per_rank, MICRO_BATCH)]
    per_rank = GLOBAL_BATCH // topo.data_size
    rows = slice(topo.data_rank * per_rank, (topo.data_rank + 1) * per_rank)
    input_ids, labels, mask = input_ids[rows], labels[rows], mask[rows]
    positions = packed_positions(GLOBAL_BATCH)[rows] if documents else None
    if topo.cp.size > 1:
        columns = sequence_index(SEQ, topo.cp.rank, topo.cp.size, context_kind)
        input_ids, labels, mask = input_ids[:, columns], labels[:, columns], mask[:, columns]
    if documents:
        return [(input_ids[i:i + MICRO_BATCH], labels[i:i + MICRO_BATCH], mask[i:i + MICRO_BATCH],
                 positions[i:i + MICRO_BATCH]) for i in range(0, per_rank, MICRO_BATCH)]
    return [(input_ids[i:i + MICRO_BATCH], labels[i:i + MICRO_BATCH], mask[i:i + MICRO_BATCH])
            for i in range(0, per_rank, MICRO_BATCH)]


def make_topology(layout: Layout) -> Topology:
    dp = layout.dp * layout.context
    return Topology.build(ParallelDims(tp=layout.tp, pp=1, dp=dp, world_size=layout.tp * dp, ep=layout.ep,
                                       cp=layout.context), layout.shard_degree)


LORA = LoraConfig(rank=4, alpha=32.0, dropout=0.0, target_modules=("q_proj", "k_proj", "v_proj", "o_proj",
                                                                   "gate_proj", "up_proj", "down_proj"))


# Preference alignment jobs: the objective, and whether the model has LoRA adapters ('dpo-lora' scores its
# reference live, with the adapters off; the others look it up in a fixed table).
PREFERENCE = {"dpo": ("dpo", "sigmoid"), "ipo": ("dpo", "ipo"), "orpo": ("orpo", "orpo"), "dpo-lora": ("dpo", "sigmoid")}


def preference_micro_batches(step: int, vocab: int, topo: Topology) -> list[tuple]:
    """GLOBAL_BATCH pairs per step (chosen: this step's sequences, rejected: another step's), the response being
    each row's tokens from position 4 on (within its unequal mask); this DP rank's pairs, MICRO_BATCH pairs per
    micro-batch as the loader cuts them: (input_ids, labels, loss_mask, None, pair_ids), chosen rows first."""
    chosen, rejected = global_batch(vocab, step), global_batch(vocab, step + 500)
    response = (torch.arange(SEQ) >= 4).float()
    per_rank = GLOBAL_BATCH // topo.data_size
    first = topo.data_rank * per_rank
    out = []
    for start in range(first, first + per_rank, MICRO_BATCH):
        rows = slice(start, start + MICRO_BATCH)
        ids, labels, mask = (torch.cat([c[rows], r[rows]]) for c, r in zip(chosen, rejected))
        out.append((ids, labels, mask * response, None, torch.arange(start, start + MICRO_BATCH) + step * GLOBAL_BATCH))
    return out


def preference_objective(kind: str, topo: Topology):
    from runtime.alignment.objective import PreferenceObjective
    from runtime.alignment.reference import live_scorer

    strategy, loss_type = PREFERENCE[kind]
    if kind == "dpo-lora":
        return PreferenceObjective(strategy, 0.1, loss_type, live=live_scorer(topo, contextlib.nullcontext))
    # Reference sums near the tiny models' starting log-probs (about -4.9 per token, 4-12 response tokens).
    table = -(torch.rand(GLOBAL_BATCH * 16, 2, generator=torch.Generator().manual_seed(3)) * 20 + 25)
    return PreferenceObjective(strategy, 0.1, loss_type, references=lambda ids: table[ids])


def step_inputs(kind: str | None, step: int, vocab: int, topo: Topology, context_kind: str = "ring"):
    """(micro-batches, objective) of one step for a job kind: None (pretraining), 'documents' (pretraining with
    separated documents), 'sft'/'lora' (packed rows) or a preference kind (PREFERENCE)."""
    if kind in PREFERENCE:
        return preference_micro_batches(step, vocab, topo), preference_objective(kind, topo)
    if kind == "documents":
        return micro_batches_for(step, vocab, topo, context_kind, documents=True), None
    return micro_batches_for(step, vocab, topo, context_kind, kind is not None), None


def fine_tuning_model(cfg: ModelConfig, fine_tuning: str | None):
    """build_model's model, for full fine-tuning ('sft') as is, for 'lora' frozen with adapters on every projection
    the model has (GPT has no gate; latent attention its own; a model with MoE layers: the attention's only), each
    adapter's B drawn non-zero so the adapters act from the first step."""
    model = build_model(cfg)
    if fine_tuning in ("lora", "dpo-lora"):
        mlp = ("gate_proj", "up_proj", "down_proj")
        targets = tuple(t for t in rules.lora_modules(cfg.architecture, cfg.latent_attention)
                        if not (cfg.moe and t in mlp))
        apply_lora(model, dataclasses.replace(LORA, target_modules=targets), seed=cfg.seed)
        gen = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if ".lora.B." in name:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
    return model


def train(cfg: ModelConfig, layout: Layout, steps: int = STEPS, clip: float = 1.0, fine_tuning: str | None = None
          ) -> dict:
    """Train `steps` steps; returns per-step losses and grad norms, the final eval loss and the full weights.
    fine_tuning: None (pretraining batches), 'sft' (packed rows, every weight trains), 'lora', or a preference
    kind (PREFERENCE)."""
    topo = make_topology(layout)
    model = fine_tuning_model(cfg, fine_tuning)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    model = parallelize_model(model, topo, sequence_parallel=layout.sequence_parallel,
                              activation_checkpointing=layout.activation_checkpointing,
                              recompute_modules=layout.recompute_modules, context=layout.context_kind,
                              attention_kernels=flash_attention_kernels,
                              data_parallel=DataParallelConfig(layout.precision, layout.zero1,
                                                                zero_stage=layout.zero_stage,
                                                                bucket_numel=BUCKET_NUMEL))
    optimizer = ShardedAdamW(model, OPTIM)
    losses, norms, dropped = [], [], []
    metrics = []
    for step in range(steps):
        batches, objective = step_inputs(fine_tuning, step, cfg.real_vocab_size, topo, layout.context_kind)
        result = train_step(model, optimizer, batches, topo, lr=OPTIM["lr"], clip=clip, objective=objective)
        losses.append(result.loss)
        norms.append(result.grad_norm)
        metrics.append(result.metrics)
        dropped.append(dropped_assignments(model, topo))
    batches, objective = step_inputs(fine_tuning, steps, cfg.real_vocab_size, topo, layout.context_kind)
    eval_loss, eval_metrics = eval_objective(model, batches, topo, objective=objective)
    state = {k: v.float() for k, v in gather_full_state_dict(model, topo).items()}
    return {"losses": losses, "grad_norms": norms, "eval_loss": eval_loss, "state": state, "dropped": dropped,
            "initial": initial, "metrics": metrics, "eval_metrics": eval_metrics}


def assert_learns(run: dict) -> None:
    """The run did train. A LoRA run on these random tiny models barely moves the loss in STEPS steps (the frozen
    random embedding and head dominate), so there: the adapters moved and every base weight is bitwise as built."""
    adapters = [name for name in run["state"] if ".lora." in name]
    if not adapters:
        assert run["losses"][-1] < run["losses"][0], "the reference run learns something"
        return
    for name, before in run["initial"].items():
        if ".lora." in name:
            assert not torch.equal(run["state"][name], before.float()), f"adapter {name} did not train"
        else:
            assert torch.equal(run["state"][name], before.float()), f"frozen base weight {name} changed"


def assert_trains_as_reference(rank: dict, ref: dict) -> None:
    """One rank's run against the single-process one: the loss and grad norm of every step within 1e-5 relative,
    the eval loss, and the objective's other figures."""
    torch.testing.assert_close(torch.tensor(rank["losses"], dtype=torch.float64),
                               torch.tensor(ref["losses"], dtype=torch.float64), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(rank["grad_norms"]), torch.tensor(ref["grad_norms"]), rtol=1e-5, atol=0)
    assert rank["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-5)
    assert_metrics_match(rank, ref)


def assert_metrics_match(rank: dict, ref: dict) -> None:
    """The objective's other figures (preference rewards, accuracy, log-probs) per step and at eval."""
    for got, want in zip(rank["metrics"] + [rank["eval_metrics"]], ref["metrics"] + [ref["eval_metrics"]]):
        assert got.keys() == want.keys()
        for name, value in want.items():
            assert got[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name


def train_job(arch: str, overrides: dict, layout: Layout, steps: int = STEPS) -> dict:
    """One job: model config overrides, plus `fine_tuning` ('sft' | 'lora' | a PREFERENCE kind), not a model key."""
    overrides = dict(overrides)
    fine_tuning = overrides.pop("fine_tuning", None)
    return train(tiny_config(arch, **overrides), layout, steps=steps, fine_tuning=fine_tuning)


def dropped_assignments(model, topo: Topology) -> list[list[int]]:
    """Per MoE layer, which (token, slot) assignments capacity dropped this step, over the global batch: the
    kept masks of every micro-batch in global batch order (each DP rank's, gathered in DP order), as flat
    indices of the dropped ones. Empty without MoE layers."""
    out = []
    for module in model.modules():
        if isinstance(module, SparseMoE):
            kept = torch.cat([t["kept"].flatten() for t in module._totals])
            module._totals = []
            everyone = torch.empty(topo.dp.size * kept.numel(), dtype=torch.float32)
            C.all_gather_flat(everyone, kept.float(), topo.dp)
            out.append(torch.nonzero(everyone == 0).flatten().tolist())
    return out


def run_suite(jobs: dict[str, tuple[str, dict, Layout]], checks: tuple[str, ...] = ()) -> dict:
    """Inside each distributed process: train every job (name -> (arch, config overrides, layout)) and run the
    named extra checks; one spawn serves a whole test module. Every rank returns its own view."""
    out = {name: train_job(arch, overrides, layout) for name, (arch, overrides, layout) in jobs.items()}
    for check in checks:
        out[check] = CHECKS[check]()
    return out


def check_vocab_parallel_cross_entropy() -> dict:
    """Local-shard CE on deterministic logits; the parent compares it with F.cross_entropy on the full vocab."""
    import torch.distributed as dist

    from runtime.parallel.layers import vocab_parallel_cross_entropy
    world = dist.get_world_size()
    topo = Topology.build(ParallelDims(tp=world, pp=1, dp=1, world_size=world))
    logits, labels, upstream = cross_entropy_inputs()
    local = logits.chunk(world, dim=-1)[topo.tp.rank].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(local, labels, topo.tp)
    (loss * upstream).sum().backward()
    # A padded vocabulary: the entries from PADDING_FROM on are no tokens (on 2 ranks, half of rank 1's shard).
    padded = logits.chunk(world, dim=-1)[topo.tp.rank].clone().requires_grad_(True)
    padded_loss = vocab_parallel_cross_entropy(padded, labels % PADDING_FROM, topo.tp, PADDING_FROM)
    (padded_loss * upstream).sum().backward()
    return {"loss": loss.detach(), "grad": local.grad, "tp_rank": topo.tp.rank,
            "padded_loss": padded_loss.detach(), "padded_grad": padded.grad}


PADDING_FROM = 48  # of cross_entropy_inputs' 64 vocabulary entries


def cross_entropy_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 5, 64, generator=gen) * 4  # (B, T, V), large enough that the max shift matters
    labels = torch.randint(0, 64, (3, 5), generator=gen)
    labels[0, 0], labels[0, 1] = 0, 63  # the first and last vocabulary entries
    upstream = torch.rand(3, 5, generator=gen)
    return logits, labels, upstream


def check_topology() -> dict:
    """Which global ranks each axis group actually sums over (all-reduce of 1 << rank)."""
    import torch.distributed as dist

    from runtime.parallel import collectives as C
    world = dist.get_world_size()
    topo = Topology.build(ParallelDims(tp=2, pp=1, dp=world // 2, world_size=world))
    seen = {}
    for axis in ("tp", "dp", "pp"):
        value = torch.tensor([1 << topo.rank], dtype=torch.int64)
        C.all_reduce(value, getattr(topo, axis))
        seen[axis] = sorted(r for r in range(world) if value.item() >> r & 1)
    return {"rank": topo.rank, "groups": seen, "ranks": {a: list(getattr(topo, a).ranks) for a in seen}}


CHECKS = {"vocab_ce": check_vocab_parallel_cross_entropy, "topology": check_topology}

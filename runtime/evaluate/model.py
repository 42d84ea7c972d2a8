# The model side of evaluation: a checkpoint loaded under the evaluation's own tp x pp (x vpp) layout, whatever
# layout trained it (runtime/checkpoint reshards on load), and the two things the tasks need from it: per-token
# scores for zero-shot tasks (scoring.LogprobFn) and the mean loss over an indexed dataset; and the weights the
# run started from (load_baseline), for tasks that score before and after.
from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.checkpoint import load_checkpoint, read_config, resolve_checkpoint
from runtime.config import parse_model_config
from runtime.finetune import checkpoint_start, prepare_from_config, starting_weights
from runtime.micro_batch import PreparedBatch
from runtime.models import ModelConfig, meta_model
from runtime.parallel import DataParallelConfig, ParallelDims, Topology, parallelize_model
from runtime.parallel.pipeline import collect_pipeline


@dataclass
class LoadedModel:
    model: torch.nn.Module
    topo: Topology
    cfg: ModelConfig
    training: dict                    # the training config saved with the checkpoint
    location: str                     # where the checkpoint was
    step: int
    saved_layout: str                 # the layout that trained it, for messages
    vpp: int | None = None            # virtual pipeline stages it was loaded with


def load_model(location: str, name: str | None, *, tp: int, pp: int, vpp: int | None, device,
               tokenizer_path: str | None = None) -> LoadedModel:
    storage, checkpoint = resolve_checkpoint(location, name)
    training = read_config(storage, checkpoint)
    tokenizer = tokenizer_path or training["model"]["tokenizer"]["model"]
    cfg = parse_model_config(training["model"], str(tokenizer))
    dims = ParallelDims.infer_dp(tp, pp, device.world_size, None)
    topo = Topology.build(dims)
    device.manual_seed(cfg.seed)
    # Each rank makes its own part only (on the meta device first). A LoRA run's checkpoint holds only its
    # adapters: first the base it started from (each rank its part of it), then the adapters.
    model = _place(prepare_from_config(meta_model(cfg), training), topo, vpp, device, checkpoint_start(training))
    load_checkpoint(storage, checkpoint, model, None, topo, rank=device.rank, with_optimizer=False)
    model.eval()
    return LoadedModel(model, topo, cfg, training, f"{storage.root}/{checkpoint.name}",
                       checkpoint.step, checkpoint.layout, vpp)


def _place(model: torch.nn.Module, topo: Topology, vpp: int | None, device, starting=None) -> torch.nn.Module:
    # Data parallelism (fp32) owns the flat weight buffers the checkpoint is loaded into; no optimizer needed.
    return parallelize_model(model, topo, sequence_parallel=False, virtual_pp=vpp, device=device.torch_device,
                             data_parallel=DataParallelConfig(), starting_weights=starting)


def load_baseline(loaded: LoadedModel, device) -> tuple[torch.nn.Module, str]:
    """The weights the checkpoint's run started from, under the same layout, and a description of them: its
    model.restore_from_path (without any LoRA adapters, which start as zero updates), else the random init of
    its model config's seed, which is exactly what training built at step 0."""
    restore = (loaded.training.get("model") or {}).get("restore_from_path")
    device.manual_seed(loaded.cfg.seed)
    model = _place(meta_model(loaded.cfg), loaded.topo, loaded.vpp, device, starting_weights(restore))
    model.eval()
    where = f"model.restore_from_path {restore}" if restore else f"random init (model.seed {loaded.cfg.seed})"
    return model, where


def _scores(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(B, T, V) full-vocabulary logits -> (B, T[, K], 2): log-prob of each target (of each of its K candidates)
    and whether it is the argmax."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    index = targets if targets.dim() == 3 else targets.unsqueeze(-1)      # (B, T, K)
    target = logprobs.gather(-1, index)
    greedy = (logprobs.argmax(dim=-1, keepdim=True) == index).float()
    scores = torch.stack([target, greedy], dim=-1)                         # (B, T, K, 2)
    return scores if targets.dim() == 3 else scores.squeeze(2)


def forward_logprobs_fn(loaded: LoadedModel, device):
    """scoring.LogprobFn over the (possibly tensor- and pipeline-parallel) model: every rank calls it with the
    same batch and gets the same answer. With pp > 1 it runs the pipeline's forward-only schedule."""
    model, topo = loaded.model, loaded.topo

    @torch.no_grad()
    def forward_logprobs(input_ids: torch.Tensor, targets: torch.Tensor):
        input_ids, targets = input_ids.to(device.torch_device), targets.to(device.torch_device)
        if topo.pp.size > 1:
            # One micro-batch per row keeps every stage busy on different rows (the schedule's whole point).
            rows = [PreparedBatch(input_ids[i:i + 1], targets[i:i + 1], None) for i in range(input_ids.shape[0])]
            parts = collect_pipeline(model, rows, topo, _scores,
                                     out_shape=lambda ids: (*ids.shape, *targets.shape[2:], 2))
            scores = torch.cat(parts)
        else:
            scores = _scores(model(input_ids), targets)
        device.step_boundary()
        scores = scores.cpu()
        return scores[..., 0], scores[..., 1].bool()

    return forward_logprobs


def greedy_tokens_fn(loaded: LoadedModel, device):
    """(input_ids (B, T) right-padded, lengths) -> (B,) the greedy next token after each row's last real token,
    over the whole vocabulary, for any layout: every rank calls it with the same rows and gets the same tokens.
    Generation through it recomputes the whole prefix every token (no KV cache): what a pipeline-parallel model
    (which runtime/generate.py does not support) generates with."""
    model, topo = loaded.model, loaded.topo

    def greedy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return logits.argmax(dim=-1).float()  # (B, T); token ids are exact in fp32 below 2^24

    @torch.no_grad()
    def next_tokens(input_ids: torch.Tensor, lengths: list[int]) -> list[int]:
        input_ids = input_ids.to(device.torch_device)
        if topo.pp.size > 1:
            rows = [PreparedBatch(input_ids[i:i + 1], input_ids[i:i + 1], None) for i in range(input_ids.shape[0])]
            tokens = torch.cat(collect_pipeline(model, rows, topo, greedy, out_shape=lambda ids: tuple(ids.shape)))
        else:
            tokens = greedy(model(input_ids), input_ids)
        device.step_boundary()
        tokens = tokens.cpu()
        return [int(tokens[row, length - 1]) for row, length in enumerate(lengths)]

    return next_tokens

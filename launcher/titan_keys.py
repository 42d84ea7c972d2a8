"""Every key of a training stage config and what it becomes in a torchtitan job (training.runtime=torchtitan): the
one table launcher/titan.py checks a launch against and explain-config --runtime torchtitan prints.

Each key has one fate:
- maps:    it becomes `titan`, a key of the generated module's context (contract 1 of docs/torchtitan.md: the ctx
           launcher/titan.py builds and launcher/titan_module.py renders);
- script:  the job script's (run.*, fault_tolerance.*, the device environment): the same sbatch and local scripts
           run the torchtitan job, so these keep their meaning;
- quiet:   tunes how nxdt-launch's runtime does the same work (overlap, workers, async saves); torchtitan does that
           work its own way, and what is trained does not change;
- named:   has no effect in the torchtitan job, and that is worth knowing (no validation, no TensorBoard events):
           a value other than `default` is named in one warning line at launch;
- refused: would train something else without its counterpart: a value other than `default` stops the launch in
           one line naming the key and what to do.
A key under a listed one (model.moe.num_experts under model.moe) takes its fate; a key the table does not list is
refused when set to anything but an empty value (None, false, 0, [], {}).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runtime.titan.shape import USE_NXDT


@dataclass(frozen=True)
class Key:
    fate: str                # maps | script | quiet | named | refused
    why: str                 # maps: how (when it is not plain); the others: why, and what to do
    titan: str | None = None  # maps: the context key it becomes
    default: Any = None      # named / refused: the value that asks for nothing torchtitan lacks


def _maps(titan: str, why: str = "") -> Key:
    return Key("maps", why, titan)


def _script(why: str) -> Key:
    return Key("script", why)


def _quiet(why: str) -> Key:
    return Key("quiet", why)


def _named(why: str, default: Any = None) -> Key:
    return Key("named", why, default=default)


def _refused(why: str, default: Any = None) -> Key:
    return Key("refused", why, default=default)


_SCRIPT = "the job script's, which runs the torchtitan job as it runs ours"
_SHAPE = "the model's shape (llama3 / qwen3 in torchtitan's own model)"
_NO_VALIDATION = "the torchtitan job runs no validation (its validator is not configured); set it to 0 to silence this"

KEYS: dict[str, Key] = {
    "runtime": _script("chooses this table"),
    "targets": _script("the recipe's layouts per cluster (launcher/targets.py), gone before the stage is read"),
    "run.name": _script("the run's name: job names and directories"),
    "run.results_dir": _maps("dump_folder"),
    "run.time_limit": _script(_SCRIPT),
    "run.dependency": _script(_SCRIPT),
    "run.preemption_signal_s": _script(_SCRIPT + "; torchtitan saves nothing on the signal: a requeued job resumes "
                                       "from its newest interval checkpoint"),
    "run.max_restarts": _script(_SCRIPT),
    "run.elastic": _refused("shrinking data parallelism after a lost node is nxdt-launch's runtime's (it re-plans the "
                            f"batch); set training.run.elastic=false {USE_NXDT}", False),
    "fault_tolerance.setup_timeout_s": _maps("comm.init_timeout_seconds", "and the watchdog's setup timeout"),
    "fault_tolerance.step_timeout_s": _maps("comm.train_timeout_seconds", "null: torchtitan's default"),
    "fault_tolerance.peer_state_every_n_steps": _refused(
        "peer-held state is nxdt-launch's runtime's (torchtitan restarts from its checkpoints); set "
        f"training.fault_tolerance.peer_state_every_n_steps=0 {USE_NXDT}", 0),
    "fault_tolerance": _script(_SCRIPT + " (restart in the job, requeue without a bad node, the watchdog)"),
    "trainer.num_nodes": _maps("parallelism", "the world size: the data-parallel degrees"),
    "trainer.devices": _maps("parallelism", "the world size: the data-parallel degrees"),
    "trainer.accelerator": _script("the job's device environment (neuron: TorchNeuron's, launcher/neuron.py)"),
    "trainer.max_steps": _maps("training.steps"),
    "trainer.log_every_n_steps": _maps("metrics.log_freq"),
    "trainer.val_check_interval": _named(_NO_VALIDATION, 0),
    "trainer.limit_val_batches": _named(_NO_VALIDATION, 0),
    "trainer.gradient_clip_val": _maps("training.max_norm", "0 (no clipping) is refused: torchtitan always clips"),
    "trainer.preflight": _named("the collective smoke test is nxdt-launch's runtime's (runtime/preflight.py)", False),
    "trainer.preflight_timeout_s": _quiet("the smoke test's, which the torchtitan job does not run"),
    "exp_manager.create_tensorboard_logger": _named("no TensorBoard events: torchtitan's metrics go to the job's "
                                                    "log every metrics.log_freq steps", False),
    "exp_manager.create_wandb_logger": _named("no W&B run: the context carries no torchtitan W&B settings", False),
    "exp_manager.wandb_logger_kwargs": _named("no W&B run: the context carries no torchtitan W&B settings"),
    "exp_manager.create_metrics_plot": _named("no metrics.png: it plots nxdt-launch's metrics.jsonl", False),
    "exp_manager.resume_if_exists": _named("torchtitan resumes from the newest step in checkpoint.folder whenever "
                                           "there is one", True),
    "exp_manager.resume_from_checkpoint": _refused(
        "a checkpoint of nxdt-launch's runtime is not a torchtitan (DCP) checkpoint: convert it to DCP into the "
        f"run's checkpoint directory and unset this, {USE_NXDT}"),
    "exp_manager.create_checkpoint_callback": _maps("checkpoint.enable"),
    "exp_manager.create_preemption_callback": _named(
        "torchtitan saves no checkpoint on SIGUSR1/SIGTERM: a preempted job resumes from its newest interval "
        "checkpoint", False),
    "exp_manager.checkpoint_callback_params.dirpath": _maps("checkpoint.folder"),
    "exp_manager.checkpoint_callback_params.every_n_train_steps": _maps("checkpoint.interval",
                                                                        "0 (only at the end): every max_steps"),
    "exp_manager.checkpoint_callback_params.save_top_k": _maps("checkpoint.keep_latest_k",
                                                               "-1: 0 (keep all); 1: 2, torchtitan's least"),
    "exp_manager.checkpoint_callback_params.save_last": _named("torchtitan always saves the last step", True),
    "exp_manager.checkpoint_callback_params.async_save": _quiet("torchtitan saves synchronously (its default)"),
    "exp_manager.checkpoint_callback_params.load_on_one_replica": _quiet("torchtitan's DCP load reads on every rank"),
    "precision.type": _maps("training.mixed_precision_param", "fp32: float32; mixed_precision and autocast: "
                            "bfloat16 compute, float32 weights and reductions; the stochastic-rounding types are "
                            "refused"),
    "model.architecture": _maps("family", "llama (Llama 3 or Qwen3 shapes) only"),
    "model.model_config": _maps("model", "its config.json decides the shape"),
    "model.model_config_overrides": _maps("model", "applied over config.json"),
    "model.num_layers": _maps("model.n_layers"),
    "model.hidden_size": _maps("model.dim"),
    "model.ffn_hidden_size": _maps("model.hidden_dim"),
    "model.num_attention_heads": _maps("model.n_heads"),
    "model.num_query_groups": _maps("model.n_kv_heads"),
    "model.kv_channels": _maps("model.head_dim", "qwen3; llama3's heads are hidden_size / num_attention_heads"),
    "model.qk_layernorm": _maps("model.qk_norm", "true: qwen3"),
    "model.rotary_base": _maps("model.rope_theta"),
    "model.layernorm_epsilon": _maps("model.norm_eps"),
    "model.max_position_embeddings": _maps("model.max_seq_len"),
    "model.share_embeddings_and_output_weights": _maps("model.tie_embeddings"),
    "model.make_vocab_size_divisible_by": _maps("model.vocab_size", "the tokenizer's vocabulary, padded"),
    "model.tokenizer.model": _maps("model.vocab_size", "its vocabulary; the data is tokenized already"),
    "model.tokenizer.library": _quiet("the data is tokenized already"),
    "model.encoder_seq_length": _maps("training.seq_len"),
    "model.micro_batch_size": _maps("training.local_batch_size", "with pipeline parallelism: the pipeline's "
                                    "microbatch, and local_batch_size the data-parallel rank's whole batch"),
    "model.global_batch_size": _maps("training.global_batch_size"),
    "model.tensor_model_parallel_size": _maps("parallelism.tensor_parallel_degree"),
    "model.sequence_parallel": _maps("parallelism.tensor_parallel_degree", "torchtitan's TP plan always splits "
                                     "norms along the sequence"),
    "model.pipeline_model_parallel_size": _maps("parallelism.pipeline_parallel_degree", "schedule 1F1B"),
    "model.virtual_pipeline_model_parallel_size": _refused(
        "the context names no virtual stages per rank; unset it (1F1B) " + USE_NXDT),
    "model.pipeline_cuts": _refused(f"torchtitan splits the layers into stages itself; unset it {USE_NXDT}"),
    "model.context_parallel_size": _maps("parallelism.context_parallel_degree"),
    "model.ulysses_parallel_size": _refused("torchtitan's context parallelism is ring attention; use "
                                            f"training.model.context_parallel_size instead, {USE_NXDT}", 1),
    "model.expert_model_parallel_size": _maps("parallelism.expert_parallel_degree", "1: the families are dense"),
    "model.zero1": _maps("parallelism.data_parallel_shard_degree", "FSDP within a node, replicated across nodes"),
    "model.zero_stage": _maps("parallelism.data_parallel_shard_degree", "FSDP within a node, replicated across "
                              "nodes"),
    "model.data_parallel_shard_degree": _maps("parallelism.data_parallel_shard_degree", "the same key: FSDP in "
                                              "groups of that many, replicated across them"),
    "model.overlap_grad_reduce": _quiet("FSDP overlaps its reductions itself"),
    "model.overlap_param_gather": _quiet("FSDP overlaps its gathers itself"),
    "model.activations_checkpoint_granularity": _maps("activation_checkpoint"),
    "model.activations_checkpoint_recompute": _named("torchtitan's selective checkpointing saves ops by its own "
                                                     "policy, not the modules listed", []),
    "model.seed": _maps("training.seed", "and data.seed"),
    "model.init_method_std": _named("torchtitan initializes its model its own way (truncated normal, depth-scaled "
                                    "output projections): a run from scratch starts from other weights"),
    "model.hidden_dropout": _refused(f"torchtitan's models have no dropout; set it to 0 {USE_NXDT}", 0),
    "model.attention_dropout": _refused(f"torchtitan's models have no dropout; set it to 0 {USE_NXDT}", 0),
    "model.ffn_dropout": _refused(f"torchtitan's models have no dropout; set it to 0 {USE_NXDT}", 0),
    "model.add_qkv_bias": _refused("biases on q, k and v (Qwen2) are in neither torchtitan family " + USE_NXDT, False),
    "model.rope_scaling": _maps("model.rope_scaling", "Llama 3.1's (rope_type llama3) as torchtitan's llama scaling; "
                                "another type, or any on Qwen3, is refused: unset it " + USE_NXDT),
    "model.moe": _refused(f"the torchtitan families here are dense; {USE_NXDT}"),
    "model.latent_attention": _refused(f"latent attention is DeepSeek's; {USE_NXDT}"),
    "model.sliding_window": _refused(f"no sliding-window attention in llama3 / qwen3; {USE_NXDT}"),
    "model.layer_types": _refused(f"no sliding-window attention in llama3 / qwen3; {USE_NXDT}"),
    "model.local_rotary_base": _refused(f"no sliding-window attention in llama3 / qwen3; {USE_NXDT}"),
    "model.softmax_scale": _refused(f"torchtitan scales attention by 1/sqrt(head_dim); {USE_NXDT}"),
    "model.restore_from_path": _refused(f"starting weights are fine-tuning's; {USE_NXDT}"),
    "model.peft": _refused(f"LoRA is fine-tuning's; {USE_NXDT}"),
    "model.data.data_prefix": _maps("data.blend"),
    "model.data.splits_string": _maps("data.splits_string"),
    "model.data.seq_length": _maps("training.seq_len"),
    "model.data.index_mapping_dir": _maps("data.index_dir"),
    "model.data.num_workers": _quiet("the generated job's loader reads in the training process"),
    "model.data.reset_position_ids": _refused("the context carries no per-document positions and masks; set it to "
                                              f"false {USE_NXDT}", False),
    "model.data.reset_attention_mask": _refused("the context carries no per-document positions and masks; set it "
                                                f"to false {USE_NXDT}", False),
    "model.optim.name": _maps("optimizer.name", "adamw: AdamW, adam: Adam; the others are refused"),
    "model.optim.lr": _maps("optimizer.lr"),
    "model.optim.betas": _maps("optimizer.beta1", "and optimizer.beta2"),
    "model.optim.eps": _maps("optimizer.eps"),
    "model.optim.weight_decay": _maps("optimizer.weight_decay"),
    "model.optim.momentum": _refused("SGD's; torchtitan's optimizers here are AdamW and Adam", 0),
    "model.optim.dampening": _refused("SGD's; torchtitan's optimizers here are AdamW and Adam", 0),
    "model.optim.nesterov": _refused("SGD's; torchtitan's optimizers here are AdamW and Adam", False),
    "model.optim.sched.name": _maps("lr_scheduler.decay_type", "CosineAnnealing: cosine; LinearAnnealing: linear; "
                                    "Constant: min_lr_factor 1"),
    "model.optim.sched.warmup_steps": _maps("lr_scheduler.warmup_steps", "+1: NeMo's warmup reaches lr at step "
                                            "warmup_steps, torchtitan's one step before its own; its decay then "
                                            "starts a step later (its 'virtual last step') and ends at the same "
                                            "step"),
    "model.optim.sched.min_lr": _maps("lr_scheduler.min_lr_factor", "min_lr / lr"),
    "model.optim.sched.max_steps": _maps("training.steps", "must equal trainer.max_steps"),
    "model.optim.sched.constant_steps": _refused(
        "torchtitan's schedule has no final hold at min_lr (its decay_ratio holds lr before the decay); set it to 0 "
        + USE_NXDT, 0),
}


def key_of(dotted: str) -> Key | None:
    """The entry for a stage key: its own, or the nearest listed key above it."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        if (entry := KEYS.get(".".join(parts[:end]))) is not None:
            return entry
    return None


def empty(value: Any) -> bool:
    return value is None or value is False or value == 0 or value in ([], {}, "")


def asks_for_more(entry: Key | None, value: Any) -> bool:
    """Whether a named or refused key's value (or an unlisted key's) asks for what torchtitan lacks."""
    if entry is None:
        return not empty(value)
    if entry.fate not in ("named", "refused"):
        return False
    if entry.default is None:
        return value is not None and value not in ([], {})
    return value != entry.default and not (empty(value) and empty(entry.default))

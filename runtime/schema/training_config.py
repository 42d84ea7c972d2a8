# The training stage's typed config: what runtime/schema/training.py builds from the YAML and the trainer reads.
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.schema import rules
from runtime.schema.model import ModelConfig


@dataclass(frozen=True)
class TrainerConfig:
    num_nodes: int
    devices: int
    accelerator: str  # cpu | gpu | neuron
    max_steps: int
    log_every_n_steps: int
    val_check_interval: int  # 0: no validation
    limit_val_batches: int  # global batches per validation
    gradient_clip_val: float  # 0: no clipping
    preflight: bool = False  # a seconds-long collective smoke test at start (runtime/preflight.py)
    preflight_timeout_s: float = 60.0


@dataclass(frozen=True)
class FaultToleranceConfig:
    """<stage>.fault_tolerance (docs/fault_tolerance.md): the hang watchdog's timeouts and what the job script does
    after a dead or hung rank (restart in the job) or a bad node (requeue without it). Defaults as NeMo's fault
    tolerance has them: 3 restarts in the job, 2 requeues, a 30-minute setup timeout, the step's learned with a
    safety factor of 5."""

    enabled: bool
    setup_timeout_s: float           # start to the first section, and any section's first run (a compile)
    step_timeout_s: float | None     # None: learned, step_timeout_factor x the slowest recent step
    step_timeout_factor: float
    step_timeout_floor_s: float
    checkpoint_timeout_s: float
    in_job_restarts: int             # workers restarted in the same allocation
    requeues_on_failure: int         # the job requeued with its bad nodes excluded
    same_node_failures: int          # failures in a row on one node before every node is checked
    peer_state_every_n_steps: int = 0  # 0: off; K: every K steps, a copy of each rank's state in other nodes' memory
    spare_nodes: int = 0             # Slurm: nodes allocated beyond trainer.num_nodes, to replace a lost one


@dataclass(frozen=True)
class ParallelConfig:
    tp: int
    pp: int
    virtual_pp: int | None
    sequence_parallel: bool
    zero1: bool
    activation_checkpointing: str | None  # None | full | selective
    recompute_modules: tuple[str, ...]
    ep: int = 1                           # model.expert_model_parallel_size: experts sharded over part of dp
    cp: int = 1                           # model.context_parallel_size: sequences split over part of dp (ring)
    ulysses: int = 1                      # model.ulysses_parallel_size: the same group, heads all-to-all'd
    overlap_grad_reduce: bool = True      # gradient buckets reduced during backward (runtime/parallel/data_parallel.py)
    overlap_param_gather: bool = True     # ZeRO-1's parameter all-gather overlapped with the optimizer's update
    pipeline_cuts: tuple[int, ...] | None = None  # model.pipeline_cuts: each stage's last layer but the last's
    zero_stage: int | None = None         # model.zero_stage: 0, 1 (what zero1 means), 2 or 3; None: zero1 as 0/1
    shard_degree: int | None = None       # model.data_parallel_shard_degree: hybrid sharding's group; None: all dp

    @property
    def stage(self) -> int:
        """The ZeRO stage: model.zero_stage, or model.zero1 read as stage 1."""
        return int(self.zero1) if self.zero_stage is None else self.zero_stage

    @property
    def context(self) -> int:
        """The context group's size: the ranks that split one sequence (one of cp, ulysses is 1)."""
        return self.cp * self.ulysses

    @property
    def context_kind(self) -> str:
        """How attention crosses the context group: 'ring' or 'ulysses' (runtime/parallel/context.py)."""
        return rules.context_kind(self.cp, self.ulysses) or "ring"


@dataclass(frozen=True)
class DataConfig:
    data_prefix: Any  # [w1, p1, ...] list or a blend file / prefix path (runtime/schema/data_prefix.py); None: sft
    splits_string: str
    seq_length: int
    micro_batch_size: int
    global_batch_size: int
    index_mapping_dir: str | None
    num_workers: int
    # model.data.reset_position_ids and reset_attention_mask (Megatron's names, both or neither): each document of
    # a pretraining sequence restarts its positions after an end-of-document token and attends only to itself.
    reset_documents: bool = False


@dataclass(frozen=True)
class SFTDataConfig:
    """model.data for fine-tuning: chat / prompt-completion records instead of a pretraining data_prefix."""

    train_files: tuple[str, ...]        # model.data.train_ds.file_names (.jsonl, .jsonl.gz, .parquet)
    validation_files: tuple[str, ...]   # model.data.validation_ds.file_names; () means none
    chat_template: str | None           # a built-in name (choices.CHAT_TEMPLATES), or None: the tokenizer's own
    packing: bool                       # several examples per sequence, attention reset at each boundary
    truncation: str                     # right | left | drop (choices.TRUNCATIONS)
    identical_pairs: str = "error"      # alignment: pairs with chosen == rejected (preference_pairs.IDENTICAL_PAIRS)


@dataclass(frozen=True)
class LoraConfig:
    """model.peft with peft_scheme: lora (NxD Training's keys)."""

    rank: int
    alpha: float
    dropout: float
    target_modules: tuple[str, ...]     # canonical names from choices.LORA_MODULES, groups expanded

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclass(frozen=True)
class AlignmentConfig:
    """The alignment stage: model_alignment_strategy.<strategy> (NxD Training's keys), preference pairs as data."""

    strategy: str                    # dpo | orpo (choices.ALIGNMENT_STRATEGIES)
    beta: float                      # dpo: kl_beta, the pull toward the reference; orpo: beta, the odds-ratio weight
    loss_type: str                   # dpo: sigmoid | ipo; orpo: "orpo"
    max_prompt_length: int           # dpo: max_dpo_prompt_length; orpo: max_prompt_length (tokens)
    truncation_mode: str             # keep_start | keep_end (choices.PROMPT_TRUNCATIONS)
    precompute_ref_log_probs: bool   # dpo: reference log-probs once before training (else LoRA's base, each step)

    @property
    def limit_key(self) -> str:
        name = "max_dpo_prompt_length" if self.strategy == "dpo" else "max_prompt_length"
        return f"model_alignment_strategy.{self.strategy}.{name}"


@dataclass(frozen=True)
class RewardModelConfig:
    """The rlhf_rm stage: a score head trained on preference pairs with TRL RewardTrainer's loss (the `reward_model`
    section; the pairs are read as the alignment stage reads them)."""

    center_rewards_coefficient: float | None  # TRL's: + coefficient * mean((r_c + r_r)^2); None or 0: none
    max_prompt_length: int                    # prompt tokens kept when prompt + response is longer than a row
    truncation_mode: str                      # keep_start | keep_end (choices.PROMPT_TRUNCATIONS)
    limit_key = "reward_model.max_prompt_length"


@dataclass(frozen=True)
class RLConfig:
    """The rl stage (GRPO): the `grpo` section, TRL GRPOConfig's keys (runtime/rl/grpo.py GRPOConfig takes `trl`)
    and ours: the reward's dotted path and the prompt limit. Prompts per step: model.global_batch_size (which counts
    completions) / num_generations."""

    trl: dict                        # num_generations .. mask_truncated_completions, as GRPOConfig(**trl) takes them
    reward: str                      # module:function
    max_prompt_length: int           # prompt tokens (with the chat template); a longer prompt is an error
    prompts_per_step: int
    reward_model: str | None = None  # a reward model (an rlhf_rm checkpoint or export) scoring instead of `reward`
    algorithm: str = "grpo"          # grpo | ppo (the ppo section: runtime/rl/ppo.py PPOConfig's keys)
    ppo: dict | None = None

    @property
    def num_generations(self) -> int:
        return self.trl["num_generations"]

    @property
    def max_completion_length(self) -> int:
        return self.trl["max_completion_length"]


@dataclass(frozen=True)
class SchedConfig:
    name: str
    warmup_steps: int
    constant_steps: int
    min_lr: float
    max_steps: int


@dataclass(frozen=True)
class OptimConfig:
    name: str
    lr: float
    weight_decay: float
    betas: tuple[float, float]
    eps: float
    sched: SchedConfig
    momentum: float = 0.0                 # sgd (and sgd_schedulefree, whose library needs it in (0, 1): 0 reads 0.9)
    dampening: float = 0.0                # sgd
    nesterov: bool = False                # sgd


@dataclass(frozen=True)
class PrecisionConfig:
    type: str  # fp32 | bf16SR | mixed_precision | mixed_precisionSR | autocast


@dataclass(frozen=True)
class SizingConfig:
    """What a trainer stage's run is sized by, as parse_sizing reads it without looking at any file: the estimator's
    input (launcher/estimator), which plans layouts on a machine that need not hold the model or the tokenizer.
    A value parse_sizing could not read is None, and its report says why."""

    model: dict                      # the model section as composed; model_shape_keys completes it from model_config
    tokenizer_path: str              # model.tokenizer.model; "" when unset
    parallel: ParallelConfig | None
    micro_batch_size: int | None
    global_batch_size: int | None
    precision: PrecisionConfig | None


@dataclass(frozen=True)
class CheckpointConfig:
    """exp_manager's checkpoint keys (NeMo names where NeMo has one; docs/checkpoints.md)."""

    enabled: bool                    # exp_manager.create_checkpoint_callback
    dirpath: str                     # checkpoint_callback_params.dirpath: a path or s3://bucket/prefix
    every_n_train_steps: int         # 0: only at the end and on a signal
    save_top_k: int                  # keep the newest K complete checkpoints; -1: keep all
    save_last: bool                  # save when training ends
    async_save: bool                 # write in the background while training goes on
    load_on_one_replica: bool        # read on data-parallel replica 0 and broadcast to the others
    resume_if_exists: bool
    resume_from_checkpoint: str | None
    save_on_signal: bool             # exp_manager.create_preemption_callback: SIGUSR1/SIGTERM save and exit


@dataclass(frozen=True)
class TrainingConfig:
    run_name: str
    results_dir: Path
    trainer: TrainerConfig
    parallel: ParallelConfig
    data: DataConfig
    optim: OptimConfig
    precision: PrecisionConfig
    model: ModelConfig
    tokenizer_path: str
    tokenizer_vocab_size: int  # before padding; model.vocab_size is the padded size
    seed: int
    tensorboard: bool
    wandb: bool
    wandb_kwargs: dict  # exp_manager.wandb_logger_kwargs, NeMo's (runtime/metrics.py maps them onto wandb.init)
    plot: bool  # metrics.png at the end of training (runtime/plot.py)
    checkpoint: CheckpointConfig
    raw: dict = field(repr=False, compare=False)  # the whole YAML, for the W&B run config
    # Fine-tuning: the weights to start from (model.restore_from_path: a Hugging Face directory or a checkpoint of
    # ours, weights only), chat data instead of data_prefix, and LoRA adapters (None: every weight trains).
    restore_from_path: str | None = None
    sft: SFTDataConfig | None = None
    lora: LoraConfig | None = None
    # The alignment stage (DPO / ORPO): sft then holds the preference files, read as pairs (runtime/alignment).
    alignment: AlignmentConfig | None = None
    # The rlhf_rm stage (a reward model): sft holds the preference files, read as pairs, as for alignment.
    reward_model: RewardModelConfig | None = None
    # The rl stage (GRPO): sft holds the prompt files ({"prompt", "answer"} records, runtime/schema/prompts.py).
    rl: RLConfig | None = None
    fault_tolerance: FaultToleranceConfig | None = None  # <stage>.fault_tolerance (the peer copies' interval)
    # run.elastic: after a lost node (no spare), the job script restarts the workers on the nodes left and says how
    # many in NXDT_ACTIVE_NODES; data parallelism shrinks and the global batch stays (runtime/train.py).
    elastic: bool = False
    # training.runtime (choices.RUNTIMES): torchtitan trains the stage instead (launcher/titan.py).
    runtime: str = "nxdt"

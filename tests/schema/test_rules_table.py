"""Every rule of the one schema (runtime/schema/rules.py), broken once each: the launcher's dry run, the launcher's
real launch and the runtime's loader on the node give the identical `error:` line, before anything is submitted."""

import copy

import pytest
import yaml

from launcher import launch
from launcher import cache
from launcher.errors import UserError
from runtime.schema.choices import ARCHITECTURES

BASE = ["stages=[training]", "training=gpt3/tiny", "cluster_type=local"]
M, T = "training.model.", "training.trainer."

# (overrides on top of BASE, the one line each side must print)
CASES = [
    ([f"{M}optim.name=lamb"],
     "training.model.optim.name: 'lamb' is not one of adamw, adam, sgd, adafactor, adamw_schedulefree, "
     "sgd_schedulefree (also accepted: adamw_fp32OptState, fused_adam, schedule_free_adamw, schedule_free_sgd)"),
    ([f"{M}optim.name=adafactor", f"{M}zero_stage=2"],
     "training.model.optim.name: adafactor factors whole 2-D parameters, so it cannot run with model.zero1 / "
     "model.zero_stage >= 1; turn it off or choose adamw, adam, sgd or a schedule-free optimizer"),
    ([f"{M}zero_stage=0", f"{M}zero1=true"],
     "training.model.zero1: true contradicts model.zero_stage 0 (zero1: true is stage 1 and stages 2 and 3 shard "
     "the optimizer state too); drop model.zero1 or make them agree"),
    ([f"{M}zero_stage=4"], "training.model.zero_stage: 4 is not a ZeRO stage; use 0, 1, 2 or 3"),
    ([f"{M}zero_stage=3", f"{T}accelerator=neuron"],
     "training.model.zero_stage: 3 frees parameter storage between uses, which XLA devices (trainer.accelerator "
     "neuron) cannot; use model.zero_stage 1 or 2"),
    ([f"+{M}data_parallel_shard_degree=2"],
     "training.model.data_parallel_shard_degree: 2 shards the optimizer state, gradients or parameters, which "
     "model.zero_stage 0 does not; set model.zero_stage to 1, 2 or 3, or "
     "training.model.data_parallel_shard_degree=null"),
    ([f"+{M}data_parallel_shard_degree=3", f"{M}zero_stage=3"],
     "training.model.data_parallel_shard_degree: 3 does not divide the 2 data-parallel ranks; use a divisor of 2 "
     "(the devices per node keep each shard group inside a node)"),
    ([f"{M}optim.name=sgd", f"+{M}optim.nesterov=true"],
     "training.model.optim.nesterov: Nesterov momentum needs model.optim.momentum > 0 and model.optim.dampening 0 "
     "(momentum 0.0, dampening 0.0)"),
    ([f"{M}optim.sched.name=Cosine"],
     "training.model.optim.sched.name: 'Cosine' is not one of CosineAnnealing, LinearAnnealing, Constant (also "
     "accepted: WarmupAnnealing, LinearAnnealingWithWarmUp); did you mean 'CosineAnnealing'?"),
    ([f"{M}tensor_model_parallel_size=2", f"{M}ffn_hidden_size=513"],
     "training.model.ffn_hidden_size: 513 is not divisible by tensor_model_parallel_size 2"),
    ([f"{T}devices=4", f"{M}tensor_model_parallel_size=4", f"{M}make_vocab_size_divisible_by=3"],
     "training.model.make_vocab_size_divisible_by: the padded vocabulary 4098 (4096 tokens rounded up to a multiple "
     "of 3) is not divisible by tensor_model_parallel_size 4; use a multiple of 4"),
    ([f"{T}num_nodes=2", f"{T}devices=3", f"{M}tensor_model_parallel_size=2", f"{M}global_batch_size=24"],
     "training.model.tensor_model_parallel_size: 2 must divide trainer.devices 3 so every tensor-parallel group "
     "stays inside one node; use a divisor of 3"),
    ([f"{T}devices=3", f"{M}tensor_model_parallel_size=1", f"{M}pipeline_model_parallel_size=2"],
     "training.trainer: num_nodes × devices = 1 × 3 = 3 is not divisible by tensor_model_parallel_size × "
     "pipeline_model_parallel_size = 1 × 2 = 2; change the node count or the parallel sizes"),
    # run.elastic (issue 62): a node to lose, and the layout one node smaller (the same rules, for that world).
    (["training.run.elastic=true"],
     "training.run.elastic: true needs trainer.num_nodes >= 2 (it is 1): a one-node job has no node to go on "
     "without; set training.run.elastic=false or train on more nodes"),
    (["training.run.elastic=true", f"{T}num_nodes=3", f"{M}global_batch_size=24"],
     "training.run.elastic: true, but the layout breaks one node smaller (trainer.num_nodes - 1 = 2 nodes, after a "
     "lost node): training.model.global_batch_size: 24 is not divisible by micro_batch_size × data-parallel size = "
     "4 × 4 = 16; use a multiple of 16; or set training.run.elastic=false"),
    # Peer-held state (issue 62): the copies a restart resumes from first may not be older than the disk's.
    (["training.fault_tolerance.peer_state_every_n_steps=20",
      "training.exp_manager.checkpoint_callback_params.every_n_train_steps=10"],
     "training.fault_tolerance.peer_state_every_n_steps: 20 is more than exp_manager.checkpoint_callback_params."
     "every_n_train_steps (10): the copies in the peers' memory would be older than the newest checkpoint on disk; "
     "use at most 10"),
    ([f"{M}global_batch_size=10"],
     "training.model.global_batch_size: 10 is not divisible by micro_batch_size × data-parallel size = 4 × 2 = 8; "
     "use a multiple of 8"),
    ([f"{M}tensor_model_parallel_size=2", f"{M}num_attention_heads=3", f"{M}hidden_size=129"],
     "training.model.num_attention_heads: 3 is not divisible by tensor_model_parallel_size 2"),
    ([f"{M}hidden_size=130"], "training.model.hidden_size: 130 is not divisible by num_attention_heads 4"),
    (["training=llama/tiny", f"{M}num_query_groups=3"],
     "training.model.num_query_groups: 3 does not divide num_attention_heads 4"),
    (["training=llama/tiny", f"{T}devices=4", f"{M}tensor_model_parallel_size=4", f"{M}num_attention_heads=12",
      f"{M}hidden_size=192", f"{M}num_query_groups=6", f"{M}ffn_hidden_size=384"],
     "training.model.num_query_groups: 6 KV heads can be neither split over nor replicated to "
     "tensor_model_parallel_size 4; one must divide the other"),
    ([f"{M}pipeline_model_parallel_size=2", f"{M}virtual_pipeline_model_parallel_size=2", f"{M}num_layers=3"],
     "training.model.num_layers: 3 is fewer than the pipeline stages, pipeline_model_parallel_size × "
     "virtual_pipeline_model_parallel_size = 2 × 2 = 4; every stage needs a layer"),
    ([f"{M}pipeline_model_parallel_size=2", f"{M}num_layers=5", f"+{M}pipeline_cuts=[1,3]"],
     "training.model.pipeline_cuts: [1, 3] must be 1 increasing layer indices below 4 (the last layer of each of "
     "the 2 stages but the last: pipeline_model_parallel_size x virtual_pipeline_model_parallel_size = 2 x 1), "
     "e.g. [1]"),
    ([f"{M}virtual_pipeline_model_parallel_size=2"],
     "training.model.virtual_pipeline_model_parallel_size: 2 needs pipeline_model_parallel_size > 1; set it to null"),
    ([f"{M}pipeline_model_parallel_size=2", f"{M}virtual_pipeline_model_parallel_size=2", f"{M}global_batch_size=12",
      f"{M}micro_batch_size=4"],
     "training.model.virtual_pipeline_model_parallel_size: the interleaved schedule needs the micro-batch count (3) "
     "to be a multiple of pipeline_model_parallel_size (2); raise global_batch_size or set "
     "virtual_pipeline_model_parallel_size=null"),
    ([f"{T}max_steps=10"],
     "training.model.optim.sched.warmup_steps: warmup_steps 15 exceeds trainer.max_steps 10; "
     "shorten the warmup or train longer"),
    ([f"{M}optim.sched.min_lr=0.1"],
     "training.model.optim.sched.min_lr: 0.1 must be between 0 and model.optim.lr 0.003"),
    ([f"{M}optim.lr=0"], "training.model.optim.lr: 0.0 must be > 0"),
    ([f"{M}max_position_embeddings=64"],
     "training.model.max_position_embeddings: 64 is smaller than encoder_seq_length 128; raise it to at least 128"),
    ([f"{M}data.seq_length=64"],
     "training.model.data.seq_length: 64 differs from model.encoder_seq_length 128; make them equal"),
    (["training.precision.type=fp8"],
     "training.precision.type: 'fp8' is not one of fp32, bf16SR, mixed_precision, mixed_precisionSR, autocast"),
    ([f"{T}accelerator=tpu"], "training.trainer.accelerator: 'tpu' is not one of cpu, gpu, neuron; did you mean 'gpu'?"),
    ([f"{M}architecture=mamba"], "training.model.architecture: 'mamba' is not one of "
     f"{', '.join(ARCHITECTURES)}; did you mean 'llama'?"),
    ([f"{M}activations_checkpoint_granularity=some"],
     "training.model.activations_checkpoint_granularity: 'some' is not one of null, full, selective"),
    ([f"{M}activations_checkpoint_recompute=[attn]"],
     "training.model.activations_checkpoint_recompute[0]: 'attn' is not one of core_attention, mlp (also accepted: "
     "CoreAttention, LlamaMLP, MLP)"),
    ([f"{M}optim.betas=[0.9]"], "training.model.optim.betas: [0.9] is invalid; expected [beta1, beta2] each in [0, 1)"),
    (["training.exp_manager.checkpoint_callback_params.save_top_k=0"],
     "training.exp_manager.checkpoint_callback_params.save_top_k: 0 is invalid; use a positive count of checkpoints "
     "to keep, or -1 to keep all"),
    ([f"{T}val_check_interval=0.5"],
     "training.trainer.val_check_interval: 0.5 must be a whole number of steps (fractions of an epoch are not "
     "supported: training is step based)"),
    (["training.run.time_limit=tomorrow"],
     "training.run.time_limit: 'tomorrow' is not a Slurm time; use H:MM:SS or D-HH:MM:SS, e.g. 4:00:00"),
    (["training.run.preemption_signal_s=1800"],
     "training.run.preemption_signal_s: 1800 s is not shorter than run.time_limit 0:30:00 (1800 s): every run would "
     "be signalled as it starts; use fewer seconds"),
    ([f"{M}hidden_dropout=1.5"], "training.model.hidden_dropout: 1.5 must be in [0, 1)"),
    ([f"{M}tokenizer.library=sentencepiece"], "training.model.tokenizer.library: 'sentencepiece' is not one of huggingface"),
    ([f"{M}micro_batch_size=0"], "training.model.micro_batch_size: 0 must be a positive integer"),
    ([f"{T}max_steps=many"], "training.trainer.max_steps: 'many' is not an integer"),
    ([f"{M}sequence_parallel=yes"], "training.model.sequence_parallel: 'yes' is not true or false"),
    (["training.run.results_dir='/tmp/a b'"],
     "training.run.results_dir: '/tmp/a b' must be an absolute path without spaces, quotes or backslashes (it "
     "appears in #SBATCH lines)"),
    (["~training.run.time_limit"],
     "training.run.time_limit: None is not a Slurm time; use H:MM:SS or D-HH:MM:SS, e.g. 4:00:00"),
    ([f"{M}activations_checkpoint_recompute=[[a]]"],
     "training.model.activations_checkpoint_recompute[0]: ['a'] is not one of core_attention, mlp (also accepted: "
     "CoreAttention, LlamaMLP, MLP)"),
    ([f"{T}val_check_interval=inf"],
     "training.trainer.val_check_interval: inf must be a whole number of steps (fractions of an epoch are not "
     "supported: training is step based)"),
    # Sliding-window layers (a folder family's keys, runtime/families): their pattern, and no context parallelism.
    ([f"{M}architecture=gemma3", f"+{M}layer_types=[sliding_attention,full_attention]"],
     "training.model.layer_types: ['sliding_attention', 'full_attention'] must list num_layers (4) of "
     "sliding_attention / full_attention"),
    ([f"{M}architecture=gemma3", f"+{M}layer_types=[sliding_attention,sliding_attention,full_attention,"
      "sliding_attention]", f"+{M}sliding_window=16", f"{M}context_parallel_size=2"],
     "training.model.context_parallel_size: 2 with sliding-window layers (model.layer_types): context parallelism "
     "here has no sliding window; set context_parallel_size=1"),
    ([f"{M}data.splits_string='90,-5,5'"],
     "training.model.data.splits_string: '90,-5,5' is invalid; expected up to three non-negative weights for "
     "train,valid,test such as '98,1,1'"),
]


def _launcher_errors(overrides, tmp_path, *, dry_run):
    with pytest.raises(UserError) as caught:
        launch.make_plan(overrides, dry_run=dry_run, produced_by="test")
    return caught.value.problems


def _runtime_errors(overrides, tmp_path, capsys, stage="training"):
    """The stage config exactly as the launcher would write it, loaded by the training program on the node."""
    from runtime.train import main

    path = tmp_path / f"{stage}_config.yaml"
    # The config the launcher composed for these overrides (its cache's contract: resolve(compose(overrides))).
    config, _ = cache.resolved(list(overrides))
    path.write_text(yaml.safe_dump(config[stage], sort_keys=False))
    capsys.readouterr()
    assert main(["--config", str(path), "--stage", stage]) == 2
    return [line.removeprefix("error: ") for line in capsys.readouterr().err.splitlines()]


@pytest.mark.parametrize("overrides,line", CASES, ids=[c[1].split(":")[0] + "-" + str(i) for i, c in enumerate(CASES)])
def test_each_rule_gives_one_identical_line_everywhere(overrides, line, recipe_data_dir, tmp_path, capsys):
    overrides = [*BASE, f"data_dir={recipe_data_dir}", f"base_results_dir={tmp_path / 'results'}", *overrides]
    dry = _launcher_errors(overrides, tmp_path, dry_run=True)
    real = _launcher_errors(overrides, tmp_path, dry_run=False)
    node = _runtime_errors(overrides, tmp_path, capsys)
    assert line in dry, dry
    assert line in real, real
    assert line in node, node
    assert set(node) <= set(real), "the runtime found a problem the launcher let through"
    assert not (tmp_path / "results").exists()


def test_other_names_for_the_same_thing_are_accepted(recipe_data_dir, tmp_path):
    plan = launch.make_plan(
        [*BASE, f"data_dir={recipe_data_dir}", f"base_results_dir={tmp_path}",
         f"{M}optim.name=adamw_fp32OptState", f"{M}optim.sched.name=LinearAnnealingWithWarmUp",
         f"{M}activations_checkpoint_granularity=selective", f"{M}activations_checkpoint_recompute=[CoreAttention]"],
        dry_run=False, produced_by="test")
    from runtime.schema.training import parse_training

    cfg, _ = parse_training(plan.cfg["training"])
    assert cfg.optim.name == "adamw" and cfg.optim.sched.name == "LinearAnnealing"
    assert cfg.parallel.recompute_modules == ("core_attention",)


def test_single_prefix_data_is_accepted_and_a_missing_one_named(recipe_data_dir, tmp_path):
    prefix = recipe_data_dir / "demo" / "corpus"
    common = [*BASE, f"data_dir={recipe_data_dir}", f"base_results_dir={tmp_path}"]
    plan = launch.make_plan([*common, f"{M}data.data_prefix={prefix}"], dry_run=False, produced_by="test")
    assert plan.warnings == []
    missing = [*common, f"{M}data.data_prefix={tmp_path}/nothing"]
    line = (f"training.model.data.data_prefix: '{tmp_path}/nothing' is neither a blend file nor a dataset prefix "
            f"(no {tmp_path}/nothing.idx); run the data_preparation stage first or point it at its output")
    assert line in _launcher_errors(missing, tmp_path, dry_run=False)
    assert line in launch.make_plan(missing, dry_run=True, produced_by="test").warnings  # a dry run only warns


def test_config_built_in_code_is_held_to_the_same_rules():
    """ModelConfig, ParallelDims and LRSchedule call the same rule functions (one definition each)."""
    from runtime.models import ModelConfig
    from runtime.optim_schedule import LRSchedule
    from runtime.parallel import ParallelDims

    with pytest.raises(ValueError, match=r"^model.hidden_size: 30 is not divisible by num_attention_heads 4$"):
        ModelConfig(architecture="gpt", vocab_size=64, hidden_size=30, num_layers=1, num_attention_heads=4,
                    ffn_hidden_size=8, max_position_embeddings=8)
    with pytest.raises(ValueError, match="must divide trainer.devices 32 so every tensor-parallel group"):
        ParallelDims.infer_dp(64, 1, 128, 32)
    with pytest.raises(ValueError, match="'Cosine' is not one of CosineAnnealing"):
        LRSchedule("Cosine", 1.0, 10)


def test_a_vocabulary_not_known_yet_is_a_warning_and_a_known_one_decides(recipe_data_dir, tmp_path):
    """tp=3 with make_vocab_size_divisible_by=128: only the tokenizer can say whether the padded vocabulary divides
    by 3 (GPT-2's 50257 pads to 50304, which does). Without it, a warning; with it, the exact rule."""
    from launcher import validate

    three = [f"{T}devices=3", f"{M}tensor_model_parallel_size=3", f"{M}num_attention_heads=3",
             f"{M}hidden_size=129", f"{M}ffn_hidden_size=516", f"{M}global_batch_size=12"]
    plan = launch.make_plan([*BASE, f"data_dir={recipe_data_dir}", f"base_results_dir={tmp_path}",
                             "stages=[data_preparation,training]", *three], dry_run=True, produced_by="test")
    assert any("whether the padded vocabulary divides by 3 is checked once the tokenizer exists" in w
               for w in plan.warnings), plan.warnings
    training = plan.cfg["training"]
    assert validate.training(training, vocab_size=50257) == []
    assert any("the padded vocabulary 4096" in e for e in validate.training(training, vocab_size=4096))

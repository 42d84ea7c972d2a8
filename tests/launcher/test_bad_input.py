"""Every user mistake: one `error:` line per problem naming the key, exit code 2, no traceback, and nothing
written or submitted. Run through the real CLI in a fresh process, as a user would meet it."""

import importlib.util

import pytest

from .helpers import nxdt, refused

# The reward model's demo, its data made by the same launch (nothing to look for on disk).
RLHF_RM = ["stages=[data_preparation,rlhf_rm]", "data_preparation=preference_demo"]
# The rl stage's demo (GRPO), its data made by the same launch.
RL = ["stages=[data_preparation,rl]", "data_preparation=rl_demo"]
CASES = [
    # (overrides, text the error line must contain)
    (["training.trainer.num_nodes=1", "training.trainer.devices=3", "training.model.tensor_model_parallel_size=2"],
     "num_nodes × devices = 1 × 3 = 3 is not divisible by tensor_model_parallel_size × pipeline_model_parallel_size = 2 × 1 = 2"),
    (["training.model.global_batch_size=10", "training.model.micro_batch_size=4"],
     "training.model.global_batch_size: 10 is not divisible by micro_batch_size × data-parallel size = 4 × 2 = 8"),
    (["training.model.num_attention_heads=6", "training.model.hidden_size=120", "training.model.tensor_model_parallel_size=4",
      "training.trainer.devices=4", "training.model.global_batch_size=4"],
     "training.model.num_attention_heads: 6 is not divisible by tensor_model_parallel_size 4"),
    (["training.model.num_layers=1", "training.model.pipeline_model_parallel_size=2"],
     "training.model.num_layers: 1 is fewer than the pipeline stages, pipeline_model_parallel_size × "
     "virtual_pipeline_model_parallel_size = 2 × 1 = 2; every stage needs a layer"),
    (["training.model.num_layers=4", "training.model.pipeline_model_parallel_size=2",
      "training.model.virtual_pipeline_model_parallel_size=4", "training.model.global_batch_size=8"],
     "= 2 × 4 = 8"),
    (["training.model.tensor_model_paralel_size=2"],
     "unknown key 'training.model.tensor_model_paralel_size': did you mean 'training.model.tensor_model_parallel_size'?"),
    (["training=gpt3/tny"], "training=gpt3/tny: no such choice; did you mean 'gpt3/tiny'? valid choices: "),
    (["cluster=pcluster_trn"], "cluster=pcluster_trn: no such choice; did you mean 'pcluster_trn"),
    (["cluster.partiton=x"], "unknown key 'cluster.partiton': did you mean 'cluster.partition'? valid keys under cluster: account,"),
    (["+cluster.constraint=a100"], "cluster.constraint: unknown key; valid keys: partition, account, exclusive"),
    (["cluster.partition='a b'"], "cluster.partition: 'a b' is not a Slurm value"),
    (["stages=[training,finetune]"], "stages: unknown stage 'finetune'; valid stages: data_preparation, training"),
    (["stages=[training", ], "override 'stages=[training' is not valid Hydra syntax"),
    (["training.run.time_limit=tomorrow"], "training.run.time_limit: 'tomorrow' is not a Slurm time"),
    (["training.run.dependency=afterwards"], "training.run.dependency: 'afterwards' is not one of afterok, afterany, singleton"),
    (["training.run.preemption_signal_s=-5"], "training.run.preemption_signal_s: -5 must be whole seconds from 0 to 65535"),
    (["training.run.preemption_signal_s=1800"],
     "training.run.preemption_signal_s: 1800 s is not shorter than run.time_limit 0:30:00 (1800 s)"),
    (["training.run.max_restarts=-1"], "training.run.max_restarts: -1 must be an integer >= 0"),
    (["training.run.max_restarts=often"], "training.run.max_restarts: 'often' is not an integer"),
    (["training.precision.type=fp8"], "training.precision.type: 'fp8' is not one of fp32, bf16SR, mixed_precision"),
    (["training.trainer.max_steps=10"], "training.model.optim.sched.warmup_steps: warmup_steps 15 exceeds trainer.max_steps 10"),
    (["training.model.architecture=mamba"], "training.model.architecture: 'mamba' is not one of gpt, llama, gemma3, gpt_oss"),
    (["cluster_type=kubernetes"], "cluster_type: 'kubernetes' is not one of auto, local, slurm, bcm"),
    (["run_name='my run'"], "run_name: 'my run' must be non-empty, without '/', spaces"),
    (["base_results_dir=relative/dir"], "base_results_dir: 'relative/dir' must be an absolute path"),
    (["env_vars.A-B=x"], "env_vars.A-B: 'A-B' is not a valid environment variable name"),
    (["env_vars.1BAD=x"], "override 'env_vars.1BAD=x' is not valid Hydra syntax (Error parsing override 'env_vars.1BAD=x')"),
    (["container=img:latest", "cluster_type=local"], "container: the local executor runs this machine's Python"),
    (["stages=[training]", "data_dir=/nonexistent/data"],
     "training.model.tokenizer.model: /nonexistent/data/demo/tokenizer.json does not exist"),
    # Hydra takes these, and the launcher used to fail on them with a traceback.
    (["stages=5"], "stages: 5 must be a non-empty list of stage names such as stages=[training]"),
    (["stages=[[training]]"], "stages: [['training']] must be a non-empty list of stage names such as stages=[training]"),
    (["=5"], "override '=5' has no key before '='; write KEY=VALUE, e.g. training.trainer.max_steps=100"),
    ([f"training.run.name={'a' * 300}"], "training.run.name: the name is 300 bytes; use at most 200"),
    (["base_results_dir=/etc/passwd"],
     "base_results_dir: cannot create /etc/passwd/gpt3_tiny: /etc/passwd is a file, not a directory; give a directory"),
    (["base_results_dir=/proc/nope"], "base_results_dir: cannot create /proc/nope/gpt3_tiny: /proc takes no new directory"),
    (["training.run.results_dir=/proc/nope/training"],
     "training.run.results_dir: cannot create /proc/nope/training: /proc takes no new directory"),
    # Messages that named the wrong thing.
    (["env_vars=[1,2]"], "env_vars: must be a mapping of NAME: value, not [1,2]; set one variable per override, "
                         "e.g. env_vars.NCCL_DEBUG=INFO"),
    (["training=../config"], "training=../config: no such choice; valid choices: gpt3/126m"),
    (["training=5"], "training=5: a config group takes the name of one of its configs; valid choices: gpt3/126m"),
    (["training.model.optim.sched.max_steps=range(1,3)"],
     "training.model.optim.sched.max_steps: 'range(1,3)' is a Hydra sweep, and nxdt-launch launches one config at a "
     "time (there is no --multirun); give one value"),
    (["training.trainer.max_steps=10,20"], "training.trainer.max_steps: '10,20' is a Hydra sweep"),
    (["training.model=[1]"], "training.model: [1] replaces a mapping of keys; set its keys one at a time"),
    # Run names that are not a directory of their own, or that Slurm would read differently from the script.
    (["training.run.name=.."], "training.run.name: '..' names no directory of its own"),
    (["training.run.name=."], "training.run.name: '.' names no directory of its own"),
    (["run_name=a%jb"], "run_name: 'a%jb' contains '%', which sbatch expands in #SBATCH --output"),
    (["run_name=1e3"], "run_name: 1000.0 is not text; quote a name made of digits, e.g. run_name='1000.0'"),
    (["training.run.results_dir=/tmp/x%j/training"],
     "training.run.results_dir: '/tmp/x%j/training' contains '%', which sbatch expands in #SBATCH --output"),
    # Preparing one corpus and training on another (NeMo-Launcher's habit: the recipe names the_pile_gpt2).
    (["stages=[data_preparation,training]", "training=gpt3/5b", "data_preparation=demo"],
     "/data/the_pile_gpt2/blend.txt' is not what data_preparation (demo_data_preparation) writes"),
    # Mixture of Experts (model.moe): what the block cannot do, before anything is submitted.
    (["training=mixtral/tiny", "training.model.moe.top_k=5"], "training.model.moe.top_k: 5 must be from 1 to num_experts (4)"),
    (["training=mixtral/tiny", "training.model.moe.dropless=false", "training.model.moe.capacity_factor=0"],
     "training.model.moe.capacity_factor: 0.0 must be a positive number; or set training.model.moe.dropless=true"),
    (["training=mixtral/tiny", "training.model.moe.frequency=5"],
     "training.model.moe.frequency: 5 must be from 1 (every layer) to num_layers (4)"),
    (["training=mixtral/tiny", "training.trainer.devices=4", "training.model.expert_model_parallel_size=3"],
     "training.model.expert_model_parallel_size: 3 must divide the data-parallel size 4"),
    (["training=mixtral/tiny", "training.trainer.devices=3", "training.model.expert_model_parallel_size=3"],
     "training.model.expert_model_parallel_size: 3 must divide training.model.moe.num_experts (4)"),
    (["training=llama/tiny", "training.trainer.devices=2", "training.model.expert_model_parallel_size=2"],
     "training.model.expert_model_parallel_size: 2 needs MoE layers"),
    (["training=mixtral/tiny", "training.model.architecture=gpt"], "training.model.moe: MoE layers are Mixtral's"),
    # Long context (context_parallel_size: ring attention; ulysses_parallel_size).
    (["training=llama/tiny", "training.model.encoder_seq_length=130", "training.model.context_parallel_size=2"],
     "training.model.encoder_seq_length: 130 is not divisible by 2 × context_parallel_size = 4 (each rank holds "
     "two chunks, for causal load balance); use a multiple of 4"),
    (["training=llama/tiny", "training.model.context_parallel_size=3"],
     "training.model.context_parallel_size: 3 must divide the data-parallel size 2"),
    (["training=llama/tiny", "training.trainer.devices=4", "training.model.global_batch_size=8",
      "training.model.num_attention_heads=6", "training.model.num_query_groups=6", "training.model.hidden_size=120",
      "training.model.tensor_model_parallel_size=2", "training.model.ulysses_parallel_size=2"],
     "training.model.ulysses_parallel_size: 2 must divide the attention heads per tensor-parallel rank "
     "(num_attention_heads 6 / tensor_model_parallel_size 2 = 3)"),
    (["training=mixtral/tiny", "training.model.context_parallel_size=2"],
     "training.model.context_parallel_size: 2 with MoE layers (model.moe.num_experts 4)"),
    (["training=gpt3/tiny", "training.model.attention_dropout=0.1", "training.model.context_parallel_size=2"],
     "training.model.attention_dropout: 0.1 with context_parallel_size 2: ring attention has no attention dropout"),
    (["training=llama/tiny", "training.model.context_parallel_size=2", "training.model.ulysses_parallel_size=2"],
     "training.model.ulysses_parallel_size: 2 together with context_parallel_size 2; split the sequence one way"),
    # Recovery in place is the Slurm script's (issue 62): asked of another executor, refused rather than dropped.
    (["training.fault_tolerance.spare_nodes=1"],
     "training.fault_tolerance.spare_nodes: only the Slurm job script recovers in place (spare nodes, peer-held "
     "state, elastic data parallelism); the local executor cannot: unset it or use cluster_type=slurm"),
    (["env_vars.NXDT_INJECT_FAULT='lost:node=node2'"], "NXDT_INJECT_FAULT='lost:node=node2': a lost fault takes node, step"),
    (["stages=[rlhf_rm,evaluation]"], "stages: evaluation scores a language model, and rlhf_rm trains a reward model"),
    # The host names the local mirror of a remote launch's files: '..' would put them anywhere.
    (["cluster.remote.host=../../x"], "cluster.remote.host: '../../x' is not a host name or address"),
    # The reward model (rlhf_rm): one score a row, at the response's last token; TRL's key spelled as TRL spells it.
    ([*RLHF_RM, "rlhf_rm.model.context_parallel_size=2"],
     "rlhf_rm.model.context_parallel_size: a context group of 2 ranks in the rlhf_rm stage: a reward model scores "
     "each row at its response's last token"),
    ([*RLHF_RM, "rlhf_rm.reward_model.center_reward_coefficient=0.01"],
     "unknown key 'rlhf_rm.reward_model.center_reward_coefficient': did you mean "
     "'rlhf_rm.reward_model.center_rewards_coefficient'?"),
    ([*RLHF_RM, "+rlhf_rm.reward_model.margin=1"], "rlhf_rm.reward_model.margin: unknown key; valid keys here: "
     "center_rewards_coefficient, max_prompt_length, truncation_mode"),
    # GRPO (rl): the reward is imported at launch; whole prompts per data-parallel rank, pipeline stages or not.
    # PPO (rl.algorithm=ppo): its own section, GRPO's loss keys left alone, one update per rollout.
    ([*RL, "+rl.ppo.kl_coef=0.1"], "rl.ppo: PPO's settings in a GRPO run; set rl.algorithm=ppo, or remove rl.ppo"),
    ([*RL, "rl=demo_ppo", "rl.grpo.beta=0.1"], "rl.grpo.beta: 0.1 is a GRPO loss setting, which a ppo run does not "
     "use; remove it or set it to 0.0"),
    ([*RL, "rl=demo_ppo", "+rl.ppo.kl_coeff=0.1"], "rl.ppo.kl_coeff: unknown key; did you mean 'kl_coef'?"),
    ([*RL, "rl=demo_ppo", "rl.ppo.num_ppo_epochs=4"], "rl.ppo.num_ppo_epochs: 4 is not supported (one PPO update "
     "per rollout); set rl.ppo.num_ppo_epochs=1"),
    ([*RL, "rl.grpo.reward=no_such_module:score"],
     "rl.grpo.reward: 'no_such_module:score': cannot import no_such_module (ModuleNotFoundError"),
    ([*RL, "rl.model.pipeline_model_parallel_size=2", "rl.trainer.devices=6"],
     "rl.model.global_batch_size: 32 prompts per step (global_batch_size / num_generations) do not divide among "
     "the 3 data-parallel ranks"),
    ([*RL, "rl.model.global_batch_size=250"],
     "rl.model.global_batch_size: 250 completions per step are not whole groups of grpo.num_generations 8"),
    ([*RL, "+rl.grpo.reward_model=/models/rm"], "rl.grpo.reward_model and rl.grpo.reward are both set; GRPO scores "
     "with one: set rl.grpo.reward=null to score with the reward model"),
    ([*RL, "rl.grpo.loss_type=ppo"], "rl.grpo.loss_type: 'ppo' is not one of grpo, bnpo, dr_grpo, dapo"),
    (["training.model.zero_stage=4"], "training.model.zero_stage: 4 is not a ZeRO stage; use 0, 1, 2 or 3"),
    (["training.model.zero_stage=0", "training.model.zero1=true"],
     "training.model.zero1: true contradicts model.zero_stage 0 (zero1: true is stage 1"),
    (["training.model.zero_stage=1.5"], "training.model.zero_stage: 1.5 is not an integer"),
    (["training.model.zero_stage=3", "training.trainer.accelerator=neuron"],
     "training.model.zero_stage: 3 frees parameter storage between uses, which XLA devices"),
    (["+training.model.data_parallel_shard_degree=2"],
     "training.model.data_parallel_shard_degree: 2 shards the optimizer state, gradients or parameters, which "
     "model.zero_stage 0 does not"),
    (["+training.model.data_parallel_shard_degree=4", "training.model.zero_stage=1"],
     "training.model.data_parallel_shard_degree: 4 does not divide the"),
]


@pytest.mark.parametrize("overrides,expected", CASES, ids=[c[1][:40] for c in CASES])
def test_bad_input_is_one_line_exit_2_nothing_written(tmp_path, overrides, expected):
    results = tmp_path / "results"
    refused(nxdt(f"base_results_dir={results}", "cluster_type=local", *overrides, cwd=tmp_path), expected)
    assert not results.exists(), "a rejected launch wrote files"
    assert not list(tmp_path.iterdir()), "a rejected launch wrote files"


def test_rl_prompts_without_the_answer_the_reward_needs_are_named_by_file_and_line(tmp_path):
    """The rl stage's local prompt files are read at launch as the job reads them (runtime/schema/prompts.py)."""
    from runtime.rl.synthetic import write_demo

    data = tmp_path / "data"
    write_demo(data / "rl_demo", num_train=20, num_valid=5, num_test=5)
    train = data / "rl_demo" / "train.jsonl"
    lines = train.read_text().splitlines()
    train.write_text("\n".join([lines[0], '{"prompt": "repeat: a b c"}', *lines[2:]]) + "\n")
    before = sorted(tmp_path.rglob("*"))
    refused(nxdt(f"base_results_dir={tmp_path}/results", f"data_dir={data}", "cluster_type=local", "stages=[rl]",
                 cwd=tmp_path),
            f"rl.model.data.train_ds.file_names: {train}:2: the record has no 'answer' (keys: prompt), which the "
            "reward compares completions with")
    assert sorted(tmp_path.rglob("*")) == before, "a rejected launch wrote files"


def test_missing_paths_are_warnings_in_a_dry_run(tmp_path):
    result = nxdt(f"base_results_dir={tmp_path}/results", "stages=[training]", "data_dir=/nonexistent",
                  "cluster_type=slurm", "--dry-run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "warning: training.model.tokenizer.model: /nonexistent/demo/tokenizer.json does not exist" in result.stdout


# Subcommands: the same contract, one `error:` line, exit 2, nothing written.
COMMAND_CASES = [
    (["stauts", "x"], "'stauts': no such command and not an override (KEY=VALUE); did you mean 'status'?"),
    (["status", "--results-dir", "/nonexistent"], "--results-dir: /nonexistent is not a directory"),
    (["estimate", "--tokens", "inf"], "--tokens 'inf' must be a finite positive number; e.g. --tokens 300e9"),
    (["estimate", "--tokens", "nan"], "--tokens 'nan' must be a finite positive number"),
    (["estimate", "--tokens", "1e400"], "--tokens '1e400' must be a finite positive number"),
    (["estimate", "--mfu", "nan"], "--mfu: nan must be a number from 0.01 to 1"),
    (["cluster-validate", "--timeout", "-5", "--dry-run"], "--timeout: -5 must be a positive number of seconds"),
    (["cluster-validate", "--timeout", "inf", "--dry-run"], "--timeout: inf must be a positive number of seconds"),
    (["cluster-config", "subnet_id=subnet-0abc", "node_setup.script_s3_uri=s3://b/x.sh", "--no-validate",
      "-o", "/etc/passwd"], "--output-dir: cannot create /etc/passwd: /etc/passwd is a file, not a directory"),
    (["cluster-config", "subnet_id=subnet-0abc", "node_setup.script_s3_uri=s3://b/x.sh", "--no-validate",
      "cluster_name=../x"], "cluster_name: '../x' must start with a letter and hold only letters, digits and '-'"),
]


@pytest.mark.parametrize("argv,expected", COMMAND_CASES, ids=[c[1][:40] for c in COMMAND_CASES])
def test_bad_subcommand_input_is_one_line_exit_2_nothing_written(tmp_path, argv, expected):
    refused(nxdt(*argv, cwd=tmp_path), expected)
    assert not list(tmp_path.iterdir()), "a rejected command wrote files"


def test_a_damaged_launch_record_is_named(tmp_path):
    """`status RUN` on a launch.json cut short: the file is named, not a JSON parser's position alone."""
    record = tmp_path / "results" / "run1" / "launch.json"
    record.parent.mkdir(parents=True)
    record.write_text('{"run_name": "run1", "stag')
    for argv in (["status", "run1"], ["logs", "run1"], ["cancel", "run1"]):
        refused(nxdt(*argv, "--results-dir", str(tmp_path / "results"), cwd=tmp_path),
                        f"{record}: not a readable launch record (")
    listing = nxdt("status", "--results-dir", str(tmp_path / "results"), cwd=tmp_path)
    assert listing.returncode == 0 and f"warning: {record}: not a readable launch record" in listing.stderr
    assert sorted(p.name for p in record.parent.iterdir()) == ["launch.json"]


def test_cluster_config_never_overwrites_a_file_it_did_not_write(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "on_node_configured.sh").write_text("#!/bin/bash\necho my own script\n")
    args = ["cluster-config", "subnet_id=subnet-0abc", "node_setup.script_s3_uri=s3://b/x.sh", "--no-validate",
            "-o", str(out)]
    refused(nxdt(*args, cwd=tmp_path), f"--output-dir: {out}/on_node_configured.sh exists and was not "
                                               "written by nxdt-launch cluster-config")
    assert sorted(p.name for p in out.iterdir()) == ["on_node_configured.sh"]
    (out / "on_node_configured.sh").unlink()
    assert nxdt(*args, cwd=tmp_path).returncode == 0
    assert nxdt(*args, cwd=tmp_path).returncode == 0, "its own output is overwritten"


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None,
                    reason="wandb is installed here (the test extra has it); tests/launcher/test_packages.py hides it")
def test_a_logger_whose_package_is_missing_is_refused_before_running(tmp_path):
    """A real local launch (not a dry run): refused at launch, not minutes into training."""
    result = nxdt(f"base_results_dir={tmp_path}/results", f"data_dir={tmp_path}/data", "cluster_type=local",
                  "stages=[data_preparation,training]", "training.exp_manager.create_wandb_logger=true",
                  cwd=tmp_path, timeout=120)
    refused(result, "training.exp_manager.create_wandb_logger: true needs the wandb package, which ")
    assert "install it: pip install wandb, or set training.exp_manager.create_wandb_logger=false" in result.stderr
    assert not list(tmp_path.iterdir())

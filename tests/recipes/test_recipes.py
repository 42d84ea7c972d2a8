"""Every training recipe composes, passes the launcher's validation and the runtime's own config checks, fits
memory by the estimator on its intended device, and renders a job script for its intended cluster (dry run)."""

import copy

import pytest

from launcher import cache, launch
from launcher.estimator import estimate
from launcher.paths import group_choices
from runtime.config import load_training_config
from tests.estimate.host_fit import host_memory_problems

GIB = 2**30


@pytest.fixture(scope="session")
def recipe_launch(recipe_data_dir, recipe_results_dir):
    """recipe -> the overrides of its dry-run launch on the cluster it is meant for (on another, its `targets` would
    compose another layout in its place), into a results directory of its own. Every test here launches or composes
    a recipe with exactly these, so launcher/cache.py's session cache (tests/conftest.py) composes each once (and
    test_recipe_table.py's row of the recipe on that cluster is the same launch)."""

    def overrides(recipe: str) -> list[str]:
        return [f"training={recipe}", f"cluster={INTENDED[recipe][0]}", "stages=[training]", "cluster_type=slurm",
                f"base_results_dir={recipe_results_dir / recipe}", f"data_dir={recipe_data_dir}"]

    return overrides


@pytest.fixture(scope="session")
def training_of(recipe_launch):
    """recipe -> its resolved training section as test_recipe_validates_fits_and_renders launches it, composed
    once per test run (several checks read every recipe); each call gets a copy of its own."""
    composed = {}

    def training(recipe: str) -> dict:
        if recipe not in composed:
            composed[recipe] = cache.resolved(recipe_launch(recipe))[0]["training"]
        return copy.deepcopy(composed[recipe])

    return training


# recipe -> (the cluster config it is meant for, the device the estimator should pick for it)
INTENDED = {
    "gpt3/tiny": ("slurm", "cpu"),
    "llama/tiny": ("slurm", "cpu"),
    "mixtral/tiny": ("slurm", "cpu"),
    "mixtral/8x7b": ("pcluster_trn1", "trn1"),
    "mixtral/8x7b_dropless": ("pcluster_trn1", "trn1"),
    "mixtral/8x7b_trn2": ("pcluster_trn2", "trn2"),
    "mixtral/8x7b_gpu": ("slurm", "h100"),
    "gpt3/126m": ("slurm", "h100"),
    "gpt3/126m_cpu": ("slurm", "cpu"),
    "gpt3/126m_trn1": ("pcluster_trn1", "trn1"),
    "gpt3/126m_trn2": ("pcluster_trn2", "trn2"),
    "gpt3/400m": ("slurm", "h100"),
    "gpt3/400m_trn1": ("pcluster_trn1", "trn1"),
    "gpt3/400m_trn2": ("pcluster_trn2", "trn2"),
    "gpt3/1b": ("slurm", "h100"),
    "gpt3/1b_trn1": ("pcluster_trn1", "trn1"),
    "gpt3/1b_trn2": ("pcluster_trn2", "trn2"),
    "gpt3/5b": ("slurm", "h100"),
    "gpt3/5b_trn1": ("pcluster_trn1", "trn1"),
    "gpt3/5b_trn2": ("pcluster_trn2", "trn2"),
    "gpt3/6.7b": ("pcluster_trn1", "trn1"),
    "gpt3/6.7b_trn2": ("pcluster_trn2", "trn2"),
    "gpt3/6.7b_gpu": ("slurm", "h100"),
    "gpt3/7b": ("slurm", "h100"),
    "gpt3/7b_trn1": ("pcluster_trn1", "trn1"),
    "gpt3/7b_trn2": ("pcluster_trn2", "trn2"),
    "gpt3/20b": ("slurm", "h100"),
    "gpt3/20b_trn1": ("pcluster_trn1", "trn1"),
    "gpt3/20b_trn2": ("pcluster_trn2", "trn2"),
    "gpt3/23b": ("pcluster_trn1", "trn1"),
    "gpt3/23b_trn2": ("pcluster_trn2", "trn2"),
    "gpt3/23b_gpu": ("slurm", "h100"),
    "gpt3/40b": ("slurm", "h100"),
    "gpt3/40b_trn1": ("pcluster_trn1", "trn1"),
    "gpt3/40b_trn2": ("pcluster_trn2", "trn2"),
    "gpt3/46b": ("pcluster_trn1", "trn1"),
    "gpt3/46b_trn2": ("pcluster_trn2", "trn2"),
    "gpt3/46b_gpu": ("slurm", "h100"),
    "gpt3/175b": ("slurm", "h100"),
    "gpt3/175b_trn1": ("pcluster_trn1", "trn1"),
    "gpt3/175b_trn2": ("pcluster_trn2", "trn2"),
    "llama2/7b": ("pcluster_trn1", "trn1"),
    "llama2/7b_trn2": ("pcluster_trn2", "trn2"),
    "llama2/7b_gpu": ("slurm", "h100"),
    "llama2/13b": ("pcluster_trn1", "trn1"),
    "llama2/13b_trn2": ("pcluster_trn2", "trn2"),
    "llama2/13b_gpu": ("slurm", "h100"),
    "llama2/70b": ("pcluster_trn1", "trn1"),
    "llama2/70b_trn2": ("pcluster_trn2", "trn2"),
    "llama2/70b_gpu": ("slurm", "h100"),
    "llama3/8b": ("pcluster_trn1", "trn1"),
    "llama3/8b_trn2": ("pcluster_trn2", "trn2"),
    "llama3/8b_gpu": ("slurm", "h100"),
    "llama3/70b": ("pcluster_trn1", "trn1"),
    "llama3/70b_trn2": ("pcluster_trn2", "trn2"),
    "llama3/70b_gpu": ("slurm", "h100"),
    "llama3/70b_cp": ("pcluster_trn1", "trn1"),
    "llama3/70b_cp_trn2": ("pcluster_trn2", "trn2"),
    "llama3/70b_cp_gpu": ("slurm", "h100"),
    "llama3_1/8b": ("pcluster_trn1", "trn1"),
    "llama3_1/8b_trn2": ("pcluster_trn2", "trn2"),
    "llama3_1/8b_gpu": ("slurm", "h100"),
    "llama3_1/8b_32k": ("pcluster_trn1", "trn1"),
    "llama3_1/8b_32k_trn2": ("pcluster_trn2", "trn2"),
    "llama3_1/8b_32k_gpu": ("slurm", "h100"),
    "llama3_1/8b_128k": ("pcluster_trn1", "trn1"),
    "llama3_1/8b_128k_trn2": ("pcluster_trn2", "trn2"),
    "llama3_1/8b_128k_gpu": ("slurm", "h100"),
    "llama3_1/70b": ("pcluster_trn1", "trn1"),
    "llama3_1/70b_trn2": ("pcluster_trn2", "trn2"),
    "llama3_1/70b_gpu": ("slurm", "h100"),
    "llama3_1/405b": ("pcluster_trn1", "trn1"),
    "llama3_1/405b_trn2": ("pcluster_trn2", "trn2"),
    "llama3_1/405b_gpu": ("slurm", "h100"),
    "llama3_3/70b": ("pcluster_trn1", "trn1"),
    "llama3_3/70b_trn2": ("pcluster_trn2", "trn2"),
    "llama3_3/70b_gpu": ("slurm", "h100"),
    "llama3_2/1b": ("pcluster_trn1", "trn1"),
    "llama3_2/1b_trn2": ("pcluster_trn2", "trn2"),
    "llama3_2/1b_gpu": ("slurm", "h100"),
    "llama3_2/3b": ("pcluster_trn1", "trn1"),
    "llama3_2/3b_trn2": ("pcluster_trn2", "trn2"),
    "llama3_2/3b_gpu": ("slurm", "h100"),
    "qwen2_5/7b": ("pcluster_trn1", "trn1"),
    "qwen2_5/7b_trn2": ("pcluster_trn2", "trn2"),
    "qwen2_5/7b_gpu": ("slurm", "h100"),
    "qwen2_5/72b": ("pcluster_trn1", "trn1"),
    "qwen2_5/72b_trn2": ("pcluster_trn2", "trn2"),
    "qwen2_5/72b_gpu": ("slurm", "h100"),
    "qwen3/8b": ("pcluster_trn1", "trn1"),
    "qwen3/8b_trn2": ("pcluster_trn2", "trn2"),
    "qwen3/8b_gpu": ("slurm", "h100"),
    "qwen3/32b": ("pcluster_trn1", "trn1"),
    "qwen3/32b_trn2": ("pcluster_trn2", "trn2"),
    "qwen3/32b_gpu": ("slurm", "h100"),
    "qwen3_moe/30b_a3b": ("pcluster_trn1", "trn1"),
    "qwen3_moe/30b_a3b_trn2": ("pcluster_trn2", "trn2"),
    "qwen3_moe/30b_a3b_gpu": ("slurm", "h100"),
}


def test_every_recipe_is_listed():
    assert sorted(INTENDED) == group_choices("training")


@pytest.mark.parametrize("recipe", sorted(INTENDED))
def test_recipe_validates_fits_and_renders(recipe, recipe_launch):
    device = INTENDED[recipe][1]
    plan = launch.make_plan(recipe_launch(recipe), dry_run=True, produced_by="test")
    # Every input path resolved into the data directory; NxD's dropless Mixtral on Trainium is told its shapes
    # follow the routing (each new one compiles).
    dropless = [w for w in plan.warnings if "model.moe.dropless: expert batch shapes follow the routing" in w]
    assert len(dropless) == (recipe == "mixtral/8x7b_dropless")
    assert [w for w in plan.warnings if w not in dropless] == []
    training = plan.cfg["training"]
    trainer = training["trainer"]

    # The runtime reads the stage config the launcher wrote and applies its own checks (tp divides the padded
    # vocabulary, the FFN and the devices per node; known keys and values).
    (script,) = launch.write(plan)
    runtime_cfg = load_training_config(plan.jobs[0].config_path)
    assert runtime_cfg.parallel.tp == training["model"]["tensor_model_parallel_size"]
    text = script.read_text()
    assert f"#SBATCH --nodes={trainer['num_nodes']}" in text
    assert f"--nproc_per_node {trainer['devices']}" in text

    neuron = ((plan.cfg.get("cluster") or {}).get("neuron") or {}).get("hardware")
    result = estimate(training, neuron_hardware=neuron, node_memory_bytes=64 * GIB)
    assert result.hardware.name == device
    assert result.fits, (f"{recipe}: {result.memory.total / GIB:.1f} GiB per device > "
                         f"{result.hardware.usable_bytes / GIB:.1f} GiB usable on {device}")
    # Host memory per node: the workers' shards, staging, data and processes within the cluster's nodes.
    assert host_memory_problems(plan.cfg, "training") == []
    # Warmup and constant phases fit in the run (the launcher checks this too; the schedules must make sense).
    sched = training["model"]["optim"]["sched"]
    assert sched["warmup_steps"] + sched["constant_steps"] <= trainer["max_steps"]


# The shapes and layouts the issue names, as NeMo-Launcher and NxD Training publish them.
PUBLISHED = {
    "gpt3/126m": dict(num_layers=12, hidden_size=768, num_attention_heads=12, encoder_seq_length=2048),
    "gpt3/5b": dict(num_layers=24, hidden_size=4096, num_attention_heads=32),
    "gpt3/20b": dict(num_layers=44, hidden_size=6144, num_attention_heads=48),
    "gpt3/40b": dict(num_layers=48, hidden_size=8192, num_attention_heads=64),
    "gpt3/175b": dict(num_layers=96, hidden_size=12288, num_attention_heads=96, encoder_seq_length=2048,
                      tensor_model_parallel_size=4, pipeline_model_parallel_size=8),
    # neuronx-nemo-megatron's gpt_6.7b.sh, gpt_23b.sh, gpt_46b.sh and gpt_175b.sh (run by its test.sh: global batch 32
    # per node, FFN 4 x hidden).
    "gpt3/6.7b": dict(num_nodes=16, devices=32, global_batch_size=512, num_layers=32, hidden_size=4096,
                     ffn_hidden_size=16384, num_attention_heads=32, tensor_model_parallel_size=8,
                     pipeline_model_parallel_size=1, micro_batch_size=1, sequence_parallel=True,
                     activations_checkpoint_granularity="full", encoder_seq_length=2048),
    "gpt3/23b": dict(num_nodes=16, devices=32, global_batch_size=512, num_layers=28, hidden_size=8192,
                    ffn_hidden_size=32768, num_attention_heads=64, tensor_model_parallel_size=8,
                    pipeline_model_parallel_size=4, micro_batch_size=1, sequence_parallel=True,
                    activations_checkpoint_granularity="selective", encoder_seq_length=2048),
    "gpt3/46b": dict(num_nodes=32, devices=32, global_batch_size=1024, num_layers=56, hidden_size=8192,
                    ffn_hidden_size=32768, num_attention_heads=64, tensor_model_parallel_size=8,
                    pipeline_model_parallel_size=8, micro_batch_size=1, sequence_parallel=True,
                    activations_checkpoint_granularity="full", encoder_seq_length=2048),
    "gpt3/175b_trn1": dict(num_nodes=32, devices=32, global_batch_size=1024, num_layers=96, hidden_size=12288,
                          ffn_hidden_size=49152, num_attention_heads=96, tensor_model_parallel_size=32,
                          pipeline_model_parallel_size=8, micro_batch_size=1, sequence_parallel=True,
                          activations_checkpoint_granularity="selective", encoder_seq_length=2048),
    "llama3/8b": dict(num_nodes=4, tensor_model_parallel_size=32, pipeline_model_parallel_size=1,
                      global_batch_size=1024, micro_batch_size=1, encoder_seq_length=8192, zero1=True,
                      sequence_parallel=True, activations_checkpoint_granularity="selective",
                      num_query_groups=8, ffn_hidden_size=14336),
    "llama3/70b": dict(num_nodes=16, tensor_model_parallel_size=32, pipeline_model_parallel_size=8),
    "llama3_1/70b": dict(num_nodes=32, tensor_model_parallel_size=32, pipeline_model_parallel_size=8),
    # NxD Training's hf_llama3.1_405B_trn1_config.yaml with Llama 3.1 405B's config.json shape.
    "llama3_1/405b": dict(num_nodes=64, devices=32, tensor_model_parallel_size=32, pipeline_model_parallel_size=32,
                          sequence_parallel=True, zero1=True, micro_batch_size=1, global_batch_size=256,
                          encoder_seq_length=8192, max_position_embeddings=131072, num_layers=126, hidden_size=16384,
                          ffn_hidden_size=53248, num_attention_heads=128, num_query_groups=8, rotary_base=500000.0,
                          activations_checkpoint_granularity="full"),
    "llama3/8b_trn2": dict(num_nodes=1, devices=64, tensor_model_parallel_size=16),
    # NxD Training's hf_llama3_70B_CP_config.yaml.
    "llama3/70b_cp": dict(num_nodes=16, devices=32, tensor_model_parallel_size=32, context_parallel_size=2,
                          pipeline_model_parallel_size=8, zero1=True, sequence_parallel=True, micro_batch_size=1,
                          global_batch_size=1024, encoder_seq_length=8192, max_position_embeddings=8192,
                          activations_checkpoint_granularity="selective",
                          activations_checkpoint_recompute=["core_attention", "mlp"]),
    # NeMo 2.0's recipes/llama3_8b_128k.py layout (its node count and batch are NeMo's defaults, not copied).
    "llama3_1/8b_128k_gpu": dict(devices=8, tensor_model_parallel_size=4, pipeline_model_parallel_size=2,
                                 context_parallel_size=8, sequence_parallel=True, encoder_seq_length=131072),
    # NeMo-Launcher's conf/training/llama/llama3_70b.yaml layout.
    "llama3/70b_cp_gpu": dict(num_nodes=128, devices=8, tensor_model_parallel_size=4, context_parallel_size=2,
                              pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=5,
                              global_batch_size=2048),
    # NxD Training's hf_mixtral_8x7b_config.yaml (and its _dropless twin) with Mixtral 8x7B's config.json shape.
    "mixtral/8x7b": dict(num_nodes=8, devices=32, tensor_model_parallel_size=32, pipeline_model_parallel_size=4,
                         expert_model_parallel_size=1, sequence_parallel=True, zero1=True, micro_batch_size=1,
                         global_batch_size=128, encoder_seq_length=4096, max_position_embeddings=4096,
                         num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                         num_query_groups=8, rotary_base=1e6, activations_checkpoint_granularity="full",
                         moe=dict(num_experts=8, top_k=2, frequency=1, dropless=False, capacity_factor=2.0,
                                  router_aux_loss_coef=0.02, router_z_loss_coef=0.0,
                                  normalize_top_k_affinities=True, router_activation="softmax")),
    "mixtral/8x7b_dropless": dict(num_nodes=8, tensor_model_parallel_size=32, pipeline_model_parallel_size=4,
                                  moe=dict(num_experts=8, top_k=2, frequency=1, dropless=True, capacity_factor=None,
                                           router_aux_loss_coef=0.02, router_z_loss_coef=0.0,
                                           normalize_top_k_affinities=True, router_activation="softmax")),
    # Llama 3.2 1B / 3B as their config.json states them (the RoPE scaling is checked below), with Megatron-Bridge's
    # GPU layouts (recipes/llama/llama32_1b.py, llama32_3b.py).
    "llama3_2/1b": dict(num_layers=16, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=32,
                        num_query_groups=8, rotary_base=500000.0, layernorm_epsilon=1e-5,
                        share_embeddings_and_output_weights=True, encoder_seq_length=8192, micro_batch_size=1,
                        global_batch_size=512),
    "llama3_2/3b": dict(num_layers=28, hidden_size=3072, ffn_hidden_size=8192, num_attention_heads=24,
                        num_query_groups=8, rotary_base=500000.0, layernorm_epsilon=1e-5,
                        share_embeddings_and_output_weights=True, encoder_seq_length=8192, micro_batch_size=1,
                        global_batch_size=512),
    "llama3_2/1b_gpu": dict(num_nodes=1, devices=8, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                            sequence_parallel=False, activations_checkpoint_granularity=None),
    "llama3_2/3b_gpu": dict(num_nodes=1, devices=8, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                            sequence_parallel=False, activations_checkpoint_granularity=None),
    # Qwen2.5 7B, Qwen3 8B and Qwen3-30B-A3B as their config.json states them (embeddings padded to its vocab_size),
    # with Megatron-Bridge's GPU layouts for the dense two (recipes/qwen/qwen2.py, qwen3.py).
    "qwen2_5/7b": dict(num_layers=28, hidden_size=3584, ffn_hidden_size=18944, num_attention_heads=28,
                       num_query_groups=4, rotary_base=1e6, layernorm_epsilon=1e-6, max_position_embeddings=131072,
                       add_qkv_bias=True, share_embeddings_and_output_weights=False,
                       make_vocab_size_divisible_by=512, encoder_seq_length=4096),
    "qwen2_5/7b_gpu": dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=1, micro_batch_size=2),
    "qwen3/8b": dict(num_layers=36, hidden_size=4096, ffn_hidden_size=12288, num_attention_heads=32,
                     num_query_groups=8, kv_channels=128, qk_layernorm=True, add_qkv_bias=False, rotary_base=1e6,
                     layernorm_epsilon=1e-6, max_position_embeddings=40960,
                     share_embeddings_and_output_weights=False, make_vocab_size_divisible_by=151936,
                     encoder_seq_length=4096),
    "qwen3/8b_gpu": dict(tensor_model_parallel_size=4, pipeline_model_parallel_size=1, micro_batch_size=2),
    # Qwen2.5 72B as the base model's config.json states it (eps 1e-5, 131072 positions; the Instruct's has 1e-6 and
    # 32768) with Megatron-Bridge's TP 8 x PP 4 on GPUs (recipes/qwen/qwen25_72b.py); Qwen3 32B as its config.json
    # states it, with Bridge's GPU layout (recipes/qwen/qwen3_32b.py: TP 8 x PP 2, micro-batch 2, full recompute).
    "qwen2_5/72b": dict(num_layers=80, hidden_size=8192, ffn_hidden_size=29568, num_attention_heads=64,
                        num_query_groups=8, rotary_base=1e6, layernorm_epsilon=1e-5, max_position_embeddings=131072,
                        add_qkv_bias=True, share_embeddings_and_output_weights=False,
                        make_vocab_size_divisible_by=512, encoder_seq_length=4096),
    "qwen2_5/72b_gpu": dict(tensor_model_parallel_size=8, pipeline_model_parallel_size=4),
    "qwen3/32b": dict(num_layers=64, hidden_size=5120, ffn_hidden_size=25600, num_attention_heads=64,
                      num_query_groups=8, kv_channels=128, qk_layernorm=True, add_qkv_bias=False, rotary_base=1e6,
                      layernorm_epsilon=1e-6, max_position_embeddings=40960,
                      share_embeddings_and_output_weights=False, make_vocab_size_divisible_by=151936,
                      encoder_seq_length=4096),
    "qwen3/32b_gpu": dict(tensor_model_parallel_size=8, pipeline_model_parallel_size=2, micro_batch_size=2,
                          sequence_parallel=False, activations_checkpoint_granularity="full"),
    # Llama 3.3 70B is Llama 3.1 70B's network (its RoPE scaling is checked below) and runs its layouts.
    "llama3_3/70b": dict(num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64,
                         num_query_groups=8, rotary_base=500000.0, layernorm_epsilon=1e-5,
                         share_embeddings_and_output_weights=False, num_nodes=32, tensor_model_parallel_size=32,
                         pipeline_model_parallel_size=8),
    "qwen3_moe/30b_a3b": dict(num_layers=48, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=32,
                              num_query_groups=4, kv_channels=128, qk_layernorm=True, add_qkv_bias=False,
                              rotary_base=1e6, layernorm_epsilon=1e-6, max_position_embeddings=40960,
                              share_embeddings_and_output_weights=False, make_vocab_size_divisible_by=151936,
                              moe=dict(num_experts=128, top_k=8, frequency=1, layers=None, ffn_hidden_size=768,
                                       dropless=False, capacity_factor=2.0, router_aux_loss_coef=0.001,
                                       router_z_loss_coef=0.0, normalize_top_k_affinities=True,
                                       router_activation="softmax")),
}


@pytest.mark.parametrize("recipe", sorted(PUBLISHED))
def test_published_shapes_and_layouts(recipe, training_of):
    training = training_of(recipe)
    flat = {**training["trainer"], **training["model"]}
    for key, value in PUBLISHED[recipe].items():
        assert flat[key] == value, (recipe, key, flat[key], value)


# Llama 3.1, 3.2 and 3.3 scale RoPE as their config.json's rope_scaling says, over their 131072 positions, in
# every recipe of theirs (the GPU ones take their layouts from llama3/*, which has none).
ROPE_SCALING = {"llama3_1": 8.0, "llama3_2": 32.0, "llama3_3": 8.0}  # family -> factor (low 1, high 4, original 8192)


def test_every_llama3_1_to_3_3_recipe_scales_rope_as_its_config_json(training_of):
    for recipe in INTENDED:
        family = recipe.split("/")[0]
        if family in ROPE_SCALING:
            model = training_of(recipe)["model"]
            assert model["max_position_embeddings"] == 131072, recipe
            assert model["rope_scaling"] == dict(rope_type="llama3", factor=ROPE_SCALING[family], low_freq_factor=1.0,
                                                 high_freq_factor=4.0, original_max_position_embeddings=8192), recipe


# The MoE recipes' expert layouts: EP divides DP, and an expert-parallel group (tp x ep consecutive ranks, see
# runtime/parallel/dims.py) stays inside one node where EP is on, so its all-to-alls never cross the network.
EXPERT_LAYOUTS = {  # recipe -> (dp, ep)
    "mixtral/8x7b": (2, 1),
    "mixtral/8x7b_dropless": (2, 1),
    "mixtral/8x7b_trn2": (4, 4),
    "mixtral/8x7b_gpu": (8, 4),
    "qwen3_moe/30b_a3b": (32, 8),
    "qwen3_moe/30b_a3b_trn2": (32, 16),
    "qwen3_moe/30b_a3b_gpu": (32, 4),
}


@pytest.mark.long("composes and validates every MoE recipe's expert layouts through Hydra")
def test_every_moe_recipe_has_its_expert_layout_checked(training_of):
    moe = [recipe for recipe in INTENDED if recipe != "mixtral/tiny"
           and training_of(recipe)["model"].get("moe")]
    assert sorted(moe) == sorted(EXPERT_LAYOUTS)


@pytest.mark.parametrize("recipe", sorted(EXPERT_LAYOUTS))
def test_moe_recipes_keep_expert_groups_inside_a_node(recipe, training_of):
    training = training_of(recipe)
    result = estimate(training)
    assert result.hardware.name == INTENDED[recipe][1]
    layout = result.layout
    assert (layout.dp, layout.ep) == EXPERT_LAYOUTS[recipe]
    assert layout.dp % layout.ep == 0 and result.shape.moe.num_experts % layout.ep == 0
    if layout.ep > 1:
        assert layout.tp * layout.ep <= layout.devices_per_node
        assert result.step.expert_parallel_s > 0
    else:
        assert result.step.expert_parallel_s == 0


# The long-context recipes' context groups: cp divides dp (the group is carved out of it), the sequence splits into
# 2·cp chunks and each rank's share over tp (sequence parallelism), RoPE covers every position, and whether a group
# (tp x cp consecutive ranks) stays inside one node, where the ring's K/V passes use the node's links.
CONTEXT_LAYOUTS = {  # recipe -> (dp, cp, inside a node)
    "llama3_1/8b_32k": (128, 4, True),
    "llama3_1/8b_32k_trn2": (32, 4, True),
    "llama3_1/8b_32k_gpu": (64, 4, True),
    "llama3_1/8b_128k": (64, 16, False),      # TP 16 x CP 16: eight trn1 nodes
    "llama3_1/8b_128k_trn2": (32, 16, False),  # four trn2 nodes
    "llama3_1/8b_128k_gpu": (16, 8, False),   # NeMo's TP 4 x CP 8: four nodes
    "llama3/70b_cp": (2, 2, False),           # NxD's TP 32 x CP 2: two trn1 nodes
    "llama3/70b_cp_trn2": (4, 2, True),
    "llama3/70b_cp_gpu": (64, 2, True),
}


def test_every_long_context_recipe_has_its_context_layout_checked(training_of):
    split = [recipe for recipe in INTENDED
             if max(training_of(recipe)["model"].get(key) or 1
                    for key in ("context_parallel_size", "ulysses_parallel_size")) > 1]
    assert sorted(split) == sorted(CONTEXT_LAYOUTS)


@pytest.mark.parametrize("recipe", sorted(CONTEXT_LAYOUTS))
def test_long_context_recipes_split_the_sequence_evenly(recipe, training_of):
    training = training_of(recipe)
    result = estimate(training, vocab_size=128256)
    layout, shape = result.layout, result.shape
    dp, cp, inside = CONTEXT_LAYOUTS[recipe]
    assert (layout.dp, layout.cp, layout.ulysses) == (dp, cp, 1)
    assert layout.dp % layout.cp == 0 and shape.seq_length % (2 * layout.cp) == 0
    assert layout.tokens_per_sample(shape.seq_length) % layout.tp == 0 and layout.sequence_parallel
    assert shape.max_position_embeddings >= shape.seq_length == training["model"]["data"]["seq_length"]
    assert (layout.tp * layout.cp <= layout.devices_per_node) == inside
    assert result.step.context_parallel_s > 0

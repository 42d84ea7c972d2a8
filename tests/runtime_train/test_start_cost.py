"""What a training process imports to build its model: not torch._dynamo, nor sympy (through torch.fx's symbolic
shapes). Building on the meta device ran PyTorch's Python meta kernels for the constructors' random fills and for
to_empty's empty_like, which import both: 4-20 s of start-up in every rank of every run on a 2-core machine, more
than a tiny model's whole training. The subject is the process's imports, so it runs in a fresh interpreter."""

import json
import os
import subprocess
import sys

from tests.launcher.helpers import REPO

SCRIPT = r"""
import json, sys
import torch
from runtime.convert.hf import state_shapes
from runtime.models import build_model
from runtime.models.lora import apply_lora
from runtime.schema.model import ModelConfig, MoEConfig
from runtime.schema.training_config import LoraConfig

shape = dict(vocab_size=128, hidden_size=32, num_layers=2, num_attention_heads=4, ffn_hidden_size=48,
             max_position_embeddings=16)
configs = [ModelConfig(architecture="gpt", share_embeddings_and_output_weights=True, **shape),
           ModelConfig(architecture="llama", num_query_groups=2, **shape),
           ModelConfig(architecture="llama", num_query_groups=2, moe=MoEConfig(num_experts=4, top_k=2), **shape)]
for cfg in configs:
    model = build_model(cfg)
    state_shapes(cfg)
    targets = ("q_proj", "v_proj")
    apply_lora(build_model(cfg), LoraConfig(rank=4, alpha=8.0, dropout=0.0, target_modules=targets), seed=0)
    tokens = torch.randint(0, 128, (2, 16))
    logits = model(tokens)
    logits.float().logsumexp(-1).mean().backward()
print(json.dumps({name: name in sys.modules for name in ("torch._dynamo", "sympy")}))
"""


def test_building_and_stepping_a_model_imports_neither_dynamo_nor_sympy():
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.splitlines()[-1]) == {"torch._dynamo": False, "sympy": False}

"""model.ffn_dropout (Megatron's, and NxD Training's megatron GPT recipe's 0.1): dropout on the MLP's hidden units,
after the activation and before the output projection, in GPT and Llama. At 0 the MLP holds no dropout at all;
at p it drops a fraction p of the hidden units in training (the survivors scaled by 1 / (1 - p)) and nothing at
evaluation; the schema checks it like the other dropouts. Like hidden and attention dropout it draws from the
generator every rank seeds alike, so no layout test compares it with one process (nor do they for those)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from runtime.models import build_model
from runtime.parallel import ParallelDims, Topology, parallelize_model
from runtime.schema.model import MoEConfig
from tests.runtime_parallel import harness as H

OUTPUT = {"gpt": "fc2", "llama": "down"}  # the MLP's output projection, whose input is what ffn_dropout drops


def _mlp_inputs(model, ids) -> torch.Tensor:
    """The output projection's input in the first layer's MLP for `ids`: the hidden units after the dropout."""
    seen = []
    hook = getattr(model.layers[0].mlp, OUTPUT[model.cfg.architecture]).register_forward_pre_hook(
        lambda _module, args: seen.append(args[0].detach().clone()))
    model(ids)
    hook.remove()
    return seen[0]


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_dropout_acts_on_the_hidden_units_in_training_only(arch):
    ids = torch.randint(0, 128, (2, H.SEQ), generator=torch.Generator().manual_seed(0))
    plain = build_model(H.tiny_config(arch)).train()
    dropped = build_model(H.tiny_config(arch, ffn_dropout=0.5)).train()
    assert not any(isinstance(m, nn.Dropout) for m in plain.layers[0].mlp.modules()), "at 0: no dropout module"
    assert plain.state_dict().keys() == dropped.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), dropped.state_dict().values()))

    torch.manual_seed(3)
    hidden = _mlp_inputs(dropped, ids)
    kept = _mlp_inputs(plain, ids)  # the same weights without dropout: the units before dropping
    zeroed = (hidden == 0) & (kept != 0)
    assert 0.4 < zeroed.float().mean().item() < 0.6
    torch.testing.assert_close(hidden[~zeroed], kept[~zeroed] * 2.0, rtol=1e-6, atol=0)
    torch.manual_seed(3)
    assert not torch.equal(dropped(ids), plain(ids))

    dropped.eval()
    assert torch.equal(dropped(ids), plain.eval()(ids)), "evaluation drops nothing"


def test_each_tensor_parallel_rank_drops_units_of_its_own_shard():
    """Under TP the MLP's hidden units are split by column; each rank's MLP keeps its dropout on its (B, T, ffn/tp)
    share (built offline for rank 1 of 2: sharding needs no collective)."""
    cfg = H.tiny_config("llama", ffn_dropout=0.1)
    topo = Topology.offline(ParallelDims(tp=2, pp=1, dp=1, world_size=2), 1)
    model = parallelize_model(build_model(cfg), topo, shapes_only=True)
    mlp = model.layers[0].mlp
    assert isinstance(mlp.dropout, nn.Dropout) and mlp.dropout.p == 0.1
    assert mlp.down.weight.shape == (cfg.hidden_size, cfg.ffn_hidden_size // 2)


@pytest.mark.parametrize("keys,line", [
    (dict(ffn_dropout=1.0), "model.ffn_dropout: 1.0 must be in [0, 1)"),
    (dict(ffn_dropout=0.1, moe=MoEConfig(num_experts=4, top_k=2)),
     "model.ffn_dropout: 0.1 with model.moe: dropout inside the experts is not built; set it to 0.0"),
])
def test_the_schema_checks_it(keys, line):
    with pytest.raises(ValueError) as caught:
        H.tiny_config("llama", **keys)
    assert line in str(caught.value)

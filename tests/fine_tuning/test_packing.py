"""Packed fine-tuning rows: several examples in one row, attention and positions reset at each example, give
each example exactly the per-token losses it has alone (runtime.models.layers.SequenceLayout)."""
from __future__ import annotations

import pytest
import torch

from runtime.models import build_model
from runtime.models.layers import SequenceLayout
from runtime.schema.model import ModelConfig
from runtime.step import eval_step
from runtime.parallel import ParallelDims, Topology


def config(arch: str) -> ModelConfig:
    return ModelConfig(architecture=arch, vocab_size=128, hidden_size=32, num_layers=2, num_attention_heads=4,
                       num_query_groups=2, ffn_hidden_size=48, max_position_embeddings=32)


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_packed_examples_have_their_unpacked_losses(arch):
    model = build_model(config(arch)).eval()
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 9, 1, 11, 6]  # 32 tokens: the last example is padding-free at the end of the row
    examples = [torch.randint(0, 128, (n + 1,), generator=gen) for n in lengths]
    inputs = torch.cat([e[:-1] for e in examples]).unsqueeze(0)
    labels = torch.cat([e[1:] for e in examples]).unsqueeze(0)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    with torch.no_grad():
        packed = model(inputs, labels, SequenceLayout.packed(positions))[0]
        start = 0
        for example, n in zip(examples, lengths):
            alone = model(example[:-1].unsqueeze(0), example[1:].unsqueeze(0))[0]
            torch.testing.assert_close(packed[start:start + n], alone, rtol=0, atol=1e-6)
            start += n


def test_the_layout_mask_is_causal_within_each_example_only():
    layout = SequenceLayout.packed(torch.tensor([[0, 1, 2, 0, 1, 0]]))
    expected = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                             [0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(layout.mask[0, 0], expected)


def test_a_packed_micro_batch_scores_like_its_examples_one_by_one():
    """Through eval_step: the token-weighted loss of a packed batch (4-tuple micro-batches) equals the same
    examples run unpacked, one per micro-batch, with the same loss masks."""
    model = build_model(config("llama"))
    topo = Topology.build(ParallelDims(tp=1, pp=1, dp=1, world_size=1))
    gen = torch.Generator().manual_seed(1)
    lengths = [7, 12, 13]
    examples = [torch.randint(0, 128, (n + 1,), generator=gen) for n in lengths]
    masks = [(torch.arange(n) >= n // 2).float() for n in lengths]  # the "assistant" half
    packed = (torch.cat([e[:-1] for e in examples])[None], torch.cat([e[1:] for e in examples])[None],
              torch.cat(masks)[None], torch.cat([torch.arange(n) for n in lengths])[None])
    one_by_one = [(e[:-1][None], e[1:][None], m[None]) for e, m in zip(examples, masks)]
    assert eval_step(model, [packed], topo) == pytest.approx(eval_step(model, one_by_one, topo), rel=1e-6)

"""Long context: ring attention and Ulysses equal full causal attention (outputs and all three gradients) on random
inputs, in real gloo processes, also with documents separated inside the rows (each query sees its own document's
keys only, some blocks then nothing); the layout each rank holds; the explicit-math block attention (what XLA and CUDA
run) equals the CPU flash kernel. Training under cp/ulysses layouts is in test_parallel_training.py."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from runtime.device import flash_attention_kernels
from runtime.parallel.context import sequence_index
from runtime.parallel.ring_attention import (block_attention, block_attention_backward, math_block_attention,
                                             math_block_attention_backward)
from runtime.parallel import ring_attention as ring_attention_module
from tests.runtime_parallel.dist_utils import run_distributed

B, HEADS, KV_HEADS, SEQ, DIM = 2, 4, 2, 32, 8


def _inputs(kv_heads: int):
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(B, n, SEQ, DIM, generator=gen) for n in (HEADS, kv_heads, kv_heads, HEADS)]  # q k v upstream


# Which document each token of the two rows belongs to: boundaries inside and between the ranks' chunks, a
# one-token document, and a row that is one document.
DOCUMENTS = torch.tensor([[0] * 3 + [1] * 9 + [2] + [3] * 13 + [4] * 6, [0] * SEQ])


def _document_mask() -> torch.Tensor:
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    return ((DOCUMENTS[:, :, None] == DOCUMENTS[:, None, :]) & causal).unsqueeze(1)


def _attend_split(cases) -> dict:
    """Inside each process: every (kind, kv_heads) case of this world size, one spawn for all of them."""
    import torch.distributed as dist

    from runtime.models.layers import CoreAttention
    from runtime.parallel import ParallelDims, Topology
    from runtime.parallel.context import RingAttention, UlyssesAttention
    world = dist.get_world_size()
    topo = Topology.build(ParallelDims(tp=1, pp=1, dp=world, world_size=world, cp=world))
    out = {}
    for kind, kv_heads, documents in cases:
        q, k, v, upstream = _inputs(kv_heads)
        index = sequence_index(SEQ, topo.cp.rank, topo.cp.size, kind)
        q, k, v = (x[:, :, index].clone().requires_grad_() for x in (q, k, v))
        attention = (RingAttention(topo.cp, flash_attention_kernels) if kind == "ring" else
                     UlyssesAttention(CoreAttention(0.0), topo.cp))
        result = attention(q, k, v, documents=DOCUMENTS) if documents else attention(q, k, v)
        (result * upstream[:, :, index]).sum().backward()
        out[kind, kv_heads, documents] = {"index": index, "out": result.detach(), "dq": q.grad, "dk": k.grad,
                                          "dv": v.grad}
    return out


def _full_attention(kv_heads: int, documents: bool = False) -> dict:
    q, k, v, upstream = _inputs(kv_heads)
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    repeat = HEADS // kv_heads
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1),
                                         attn_mask=_document_mask() if documents else None, is_causal=not documents)
    (out * upstream).sum().backward()
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


CASES = {2: [("ring", KV_HEADS, False), ("ulysses", KV_HEADS, False), ("ring", KV_HEADS, True),
            ("ulysses", KV_HEADS, True)],
         4: [("ring", KV_HEADS, False), ("ring", 1, False), ("ulysses", 1, False), ("ring", 1, True)]}


@functools.cache
def _split_results(world: int) -> list[dict]:
    return run_distributed(_attend_split, world, args=(CASES[world],))


@pytest.mark.parametrize("world,kind,kv_heads,documents", [(w, *case) for w, cases in CASES.items() for case in cases])
def test_split_attention_equals_full_attention(world, kind, kv_heads, documents):
    ranks = [r[kind, kv_heads, documents] for r in _split_results(world)]
    full = _full_attention(kv_heads, documents)
    covered = torch.cat([r["index"] for r in ranks]).sort().values
    assert torch.equal(covered, torch.arange(SEQ)), "the ranks hold every position exactly once"
    for r in ranks:
        for name in ("out", "dq", "dk", "dv"):
            torch.testing.assert_close(r[name], full[name][:, :, r["index"]], rtol=1e-5, atol=1e-5, msg=name)


def test_ring_layout_balances_causal_work():
    # Rank r holds chunks r and 2·cp−1−r: every rank's queries see the same number of keys in total.
    assert sequence_index(16, 0, 2, "ring").tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert sequence_index(16, 1, 2, "ring").tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert sequence_index(16, 1, 2, "ulysses").tolist() == list(range(8, 16))
    for cp in (2, 4, 8):
        work = [sum(int(p) + 1 for p in sequence_index(64, r, cp, "ring")) for r in range(cp)]
        assert len(set(work)) == 1, work


@pytest.mark.parametrize("causal", [True, False])
def test_explicit_block_attention_equals_the_flash_kernel(causal, monkeypatch):
    monkeypatch.setattr(ring_attention_module, "TILE", 5)  # several query tiles, the last one short
    gen = torch.Generator().manual_seed(5)
    q, k, v, grad = (torch.randn(2, 3, 12, 8, generator=gen) for _ in range(4))
    scale = 8 ** -0.5
    kernels = flash_attention_kernels(q)
    assert kernels is not None, "CPU has the fused kernels"
    out, lse = block_attention(q, k, v, causal, scale, kernels)
    math_out, math_lse = math_block_attention(q, k, v, causal, scale)
    torch.testing.assert_close(math_out, out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(math_lse, lse, rtol=1e-5, atol=1e-6)
    fused = block_attention_backward(grad, q, k, v, out, lse, causal, scale, kernels)
    for got, expected in zip(math_block_attention_backward(grad, q, k, v, out, lse, causal, scale), fused):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)

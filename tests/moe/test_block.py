"""The sparse MoE block (runtime/models/moe.py) on its own: routing and the auxiliary losses against values worked
out by hand, transformers' MixtralSparseMoeBlock for the output, token dropping under a capacity factor, the
auxiliary loss's gradient, and the load-balancing loss balancing a router that starts unbalanced."""
import math

import pytest
import torch

from runtime.models.moe import (SparseMoE, attach_aux_loss, capacity, kept_assignments, load_balancing_loss, route,
                                router_z_loss)


def test_routing_and_aux_losses_equal_a_hand_computed_example():
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 3.0], [1.0, 2.0, 0.5], [0.5, 0.0, 0.0]])
    routing = route(logits, 2, normalize=True)
    e = [[math.exp(v) for v in row] for row in logits.tolist()]
    probs = [[v / sum(row) for v in row] for row in e]
    assert torch.allclose(routing.probs, torch.tensor(probs), rtol=1e-6)
    # Token 0: experts 0 (p0) and 1 (p1), renormalized over the two.
    assert routing.experts.tolist() == [[0, 1], [2, 0], [1, 0], [0, 1]]  # token 1: a tie at 0 and 1, lower wins
    p = probs[0]
    assert routing.weights[0].tolist() == pytest.approx([p[0] / (p[0] + p[1]), p[1] / (p[0] + p[1])], rel=1e-6)
    # Load balancing: assignments per expert 4, 3, 1 of 4 tokens; mean probabilities per expert.
    counts = [4, 3, 1]
    mean_p = [sum(row[i] for row in probs) / 4 for i in range(3)]
    assert load_balancing_loss(routing, 3).item() == pytest.approx(3 * sum(c / 4 * m for c, m in zip(counts, mean_p)),
                                                                   rel=1e-6)
    z = sum(math.log(sum(row)) ** 2 for row in e) / 4
    assert router_z_loss(routing).item() == pytest.approx(z, rel=1e-6)
    # Sigmoid scores, not renormalized: the raw sigmoid of the chosen logits.
    sig = route(logits, 1, activation="sigmoid", normalize=False)
    assert sig.weights[:, 0].tolist() == pytest.approx([1 / (1 + math.exp(-2.0)), 1 / (1 + math.exp(-3.0)),
                                                        1 / (1 + math.exp(-2.0)), 1 / (1 + math.exp(-0.5))], rel=1e-6)


def test_output_equals_transformers_mixtral_block():
    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = transformers.MixtralConfig(hidden_size=32, intermediate_size=48, num_local_experts=4,
                                        num_experts_per_tok=2, router_jitter_noise=0.0)
    torch.manual_seed(0)
    theirs = MixtralSparseMoeBlock(config).eval()
    for param in theirs.parameters():
        torch.nn.init.normal_(param, std=0.2)
    ours = SparseMoE(32, 48, 4, 2).eval()
    with torch.no_grad():
        ours.router.weight.copy_(theirs.gate.weight)
        ours.gate_up.copy_(theirs.experts.gate_up_proj.transpose(1, 2))  # HF keeps (E, out, in)
        ours.down.copy_(theirs.experts.down_proj.transpose(1, 2))
    x = torch.randn(3, 7, 32)
    with torch.no_grad():
        expected, got = theirs(x.clone()), ours(x)
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6), (got - expected).abs().max()


def test_capacity_drops_the_latest_arrivals_at_each_expert():
    experts = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])
    assert capacity(4, 2, 3, 0.75) == 2  # ceil(0.75 * 4 * 2 / 3)
    kept = kept_assignments(experts, 3, 2)
    # Expert 0 gets (0,0), (1,0), (2,0), (3,1) in (token, slot) order: the third and fourth are dropped.
    assert kept.tolist() == [[True, True], [True, True], [False, True], [False, False]]
    assert kept_assignments(experts, 3, None).all()

    torch.manual_seed(1)
    block = SparseMoE(16, 24, 4, 2, capacity_factor=0.5)
    for param in block.parameters():
        torch.nn.init.normal_(param, std=0.3)
    x = torch.randn(2, 8, 16)
    out = block(x)
    limit = capacity(16, 2, 4, 0.5)
    assert int(block.stats["load"].max()) <= limit
    dropped = 1.0 - block.stats["load"].sum().item() / 32
    assert block.stats["dropped"].item() == pytest.approx(dropped) and dropped > 0
    # Each token gets the weighted outputs of the experts that kept it, and nothing from those that dropped it,
    # through the fixed-size batches (compared with one token at a time, values and input gradient).
    xs = x.clone().requires_grad_(True)
    out = block(xs)
    ref_x = x.clone().requires_grad_(True)
    expected = _one_token_at_a_time(block, ref_x, kept_assignments(route(block.router(x.reshape(-1, 16)), 2).experts,
                                                                   4, limit))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    out.square().sum().backward()
    expected.square().sum().backward()
    # The gradient sums the same terms in another order (batched matmuls against one token at a time): a few fp32
    # ulps apart, which the CPU's kernels decide (2.9e-6 on a 0.075 gradient on one machine). A dropped assignment
    # counted, or a kept one lost, moves it by a whole expert's contribution, orders of magnitude more.
    torch.testing.assert_close(xs.grad, ref_x.grad, rtol=1e-4, atol=1e-5)
    block.capacity_factor = None
    assert not torch.allclose(block(x), out)


def _one_token_at_a_time(block, x, kept):
    tokens = x.reshape(-1, x.shape[-1])
    routing = route(block.router(tokens), block.top_k)
    rows = []
    for t in range(tokens.shape[0]):
        total = torch.zeros_like(tokens[t])
        for s in range(block.top_k):
            if kept[t, s]:
                e = routing.experts[t, s]
                gate, up = (tokens[t] @ block.gate_up[e]).chunk(2)
                total = total + routing.weights[t, s] * (torch.nn.functional.silu(gate) * up) @ block.down[e]
        rows.append(total)
    return torch.stack(rows).view_as(x)


def test_the_aux_loss_gradient_arrives_through_the_output():
    torch.manual_seed(2)
    block = SparseMoE(8, 12, 4, 2, aux_loss_coef=0.01, z_loss_coef=0.001).train()
    x = torch.randn(2, 5, 8)
    block.aux_scale = 0.25
    block(x).sum().backward()
    attached = block.router.weight.grad.clone()
    block.zero_grad()
    block.aux_scale = 0.0  # the same forward with the auxiliary loss's gradient switched off, plus it by hand
    out = block(x)
    routing = route(block.router(x.reshape(-1, 8)), 2)
    aux = 0.01 * load_balancing_loss(routing, 4) + 0.001 * router_z_loss(routing)
    (out.sum() + 0.25 * aux).backward()
    assert torch.allclose(attached, block.router.weight.grad, rtol=1e-6, atol=1e-8)
    assert torch.equal(attach_aux_loss(x, aux.detach().requires_grad_(), 1.0), x)


def test_the_load_balancing_loss_balances_a_router_that_starts_unbalanced():
    torch.manual_seed(3)
    block = SparseMoE(16, 8, 4, 1, aux_loss_coef=1.0).train()
    x = torch.randn(256, 16)
    x[:, 0] = 1.0  # a constant feature: through it the router prefers expert 0 for every token
    with torch.no_grad():
        block.router.weight.normal_(std=0.3)
        block.router.weight[0, 0] += 3.0
    optimizer = torch.optim.Adam(block.router.parameters(), lr=0.05)

    def imbalance() -> float:  # max / mean tokens per expert: 1.0 is balanced, 4.0 all on one of four
        load = block.stats["load"].float()
        return (load.max() / load.mean()).item()

    history = []
    for _ in range(30):  # the auxiliary loss alone (the output's own gradient is zero), through the block's path
        optimizer.zero_grad()
        (block(x) * 0.0).sum().backward()
        history.append(imbalance())
        optimizer.step()
    assert history[0] > 3.5 and history[-1] < 1.3, history

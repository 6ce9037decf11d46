"""``models.MoE``: both computations (tokens grouped by expert; every expert on every
token) equal a float64 loop over tokens and their chosen experts, under the transforms;
and the MoE Transformer's router logits."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import torchfn
from torchfn import losses, random
from torchfn.models import KVCache, MoE, TransformerEncoder, _moe, moe_bias_update


def loop_reference(params, x, top_k, mlp="swiglu", normalize=True):
    """Token by token: the router's top-k experts, each run alone, weighted; plus the
    shared expert (sigmoid-gated where it has a gate) if there is one."""
    tokens = x.reshape(-1, x.shape[-1])
    probs = (tokens @ params["router.weight"].T).softmax(-1)
    out = []
    for t, p in zip(tokens, probs):
        w, chosen = p.topk(top_k)
        w = w / w.sum() if normalize else w
        acc = torch.zeros_like(t)
        for weight, e in zip(w, chosen):
            h = params["up"][e] @ t
            if mlp == "swiglu":
                h = torch.nn.functional.silu(params["gate"][e] @ t) * h
            else:
                h = torch.nn.functional.gelu(h)
            acc = acc + weight * (params["down"][e] @ h)
        if "shared.up.weight" in params:  # SwiGLU
            h = torch.nn.functional.silu(params["shared.gate.weight"] @ t) * (
                params["shared.up.weight"] @ t)
            shared = params["shared.down.weight"] @ h
        elif "shared.0.weight" in params:  # GELU MLP
            shared = params["shared.2.weight"] @ torch.nn.functional.gelu(
                params["shared.0.weight"] @ t)
        else:
            shared = 0
        if "gate_shared.weight" in params:
            shared = torch.sigmoid(params["gate_shared.weight"] @ t) * shared
        out.append(acc + shared)
    return torch.stack(out).reshape(x.shape)


def setup(experts=4, top_k=2, mlp="swiglu", normalize=True, shape=(3, 5), dim=8, seed=0,
          **shared):
    model = torchfn.Model(MoE(dim, 12, experts, top_k, mlp=mlp, normalize=normalize,
                              **shared))
    params = {n: p.double() for n, p in model.init(random.key(seed)).items()}
    x = random.normal(random.key(seed + 1), (*shape, dim), torch.float64)
    return model, params, x


@pytest.fixture(params=["sparse", "dense"])
def path(request, monkeypatch):
    """Run each test on both computations: ``dense`` forces every expert on every token."""
    if request.param == "dense":
        monkeypatch.setattr(_moe, "_batched_transform_active", lambda: True)
    return request.param


@settings(max_examples=15, deadline=None)
@given(experts=st.integers(1, 6), data=st.data(), mlp=st.sampled_from(["swiglu", "gelu"]),
       normalize=st.booleans(), shape=st.sampled_from([(7,), (2, 5), (1, 1, 3)]),
       seed=st.integers(0, 2**20),
       shared=st.sampled_from([{}, {"shared_hidden": 6},
                               {"shared_hidden": 10, "shared_gate": True}]))
def test_both_paths_equal_the_token_loop(experts, data, mlp, normalize, shape, seed, shared):
    top_k = data.draw(st.integers(1, experts))
    model, params, x = setup(experts, top_k, mlp, normalize, shape, seed=seed, **shared)
    want = loop_reference(params, x, top_k, mlp, normalize)
    sparse = model.apply(params, x)
    _moe_dense = _moe._batched_transform_active
    try:
        _moe._batched_transform_active = lambda: True
        dense = model.apply(params, x)
    finally:
        _moe._batched_transform_active = _moe_dense
    torch.testing.assert_close(sparse, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(dense, want, rtol=0, atol=1e-12)


def test_grad_jvp_and_jacrev_equal_the_loop(path):
    model, params, x = setup()

    def loss(f):
        return lambda p, x: f(p, x).square().sum()

    ours = loss(lambda p, x: model.apply(p, x))
    ref = loss(lambda p, x: loop_reference(p, x, 2))
    g, g_ref = torch.func.grad(ours, argnums=(0, 1))(params, x), \
        torch.func.grad(ref, argnums=(0, 1))(params, x)
    for a, b in zip(torch.utils._pytree.tree_leaves(g), torch.utils._pytree.tree_leaves(g_ref)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    tx = random.normal(random.key(9), x.shape, torch.float64)
    _, t = torch.func.jvp(lambda x: model.apply(params, x), (x,), (tx,))
    _, t_ref = torch.func.jvp(lambda x: loop_reference(params, x, 2), (x,), (tx,))
    torch.testing.assert_close(t, t_ref, rtol=0, atol=1e-12)
    j = torch.func.jacrev(lambda x: model.apply(params, x))(x[0, :2])
    j_ref = torch.func.jacrev(lambda x: loop_reference(params, x, 2))(x[0, :2])
    torch.testing.assert_close(j, j_ref, rtol=0, atol=1e-12)


def test_per_sample_gradients_under_vmap_equal_a_loop():
    """vmap takes the dense computation; each example's gradient equals grad alone."""
    model, params, x = setup()
    seen = []
    real = _moe._batched_transform_active
    spy = lambda: seen.append(real()) or seen[-1]  # noqa: E731

    def loss(p, xi):
        return model.apply(p, xi).square().sum()

    _moe._batched_transform_active = spy
    try:
        per = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)
        assert seen and all(seen)
        seen.clear()
        loop = [torch.func.grad(loss)(params, xi) for xi in x]
        assert seen and not any(seen)
    finally:
        _moe._batched_transform_active = real
    for name in params:
        torch.testing.assert_close(per[name], torch.stack([g[name] for g in loop]),
                                   rtol=0, atol=1e-12)


def test_compiles_fullgraph_to_the_same_values():
    torch._dynamo.reset()
    model, params, x = setup()
    params = {n: p.float() for n, p in params.items()}
    x = x.float()
    compiled = torch.compile(lambda p, x: model.apply(p, x), fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(params, x), model.apply(params, x), rtol=1e-5,
                               atol=1e-6)


def capacity_reference(params, x, top_k, factor, mlp="swiglu", normalize=True):
    """GShard's capacity written out: over a call's T tokens, every first choice (in
    token order), then every second one, ...; an expert takes the first
    ceil(factor * T * top_k / E) assignments it gets, and the rest add nothing."""
    tokens = x.reshape(-1, x.shape[-1])
    e = params["router.weight"].shape[0]
    cap = max(1, math.ceil(factor * tokens.shape[0] * top_k / e))
    probs = (tokens @ params["router.weight"].T).softmax(-1)
    w, chosen = probs.topk(top_k, dim=-1)
    w = w / w.sum(-1, keepdim=True) if normalize else w
    taken = [0] * e
    out = torch.zeros_like(tokens)
    for slot in range(top_k):
        for i, t in enumerate(tokens):
            j = int(chosen[i, slot])
            if taken[j] < cap:
                taken[j] += 1
                h = params["up"][j] @ t
                h = (torch.nn.functional.silu(params["gate"][j] @ t) * h if mlp == "swiglu"
                     else torch.nn.functional.gelu(h))
                out[i] = out[i] + w[i, slot] * (params["down"][j] @ h)
    return out.reshape(x.shape)


@settings(max_examples=15, deadline=None)
@given(experts=st.integers(1, 6), data=st.data(), mlp=st.sampled_from(["swiglu", "gelu"]),
       factor=st.sampled_from([0.25, 0.5, 1.0, 1.25]), shape=st.sampled_from([(7,), (2, 5)]),
       seed=st.integers(0, 2**20))
def test_capacity_drops_exactly_the_assignments_past_each_experts_capacity(
        experts, data, mlp, factor, shape, seed):
    top_k = data.draw(st.integers(1, experts))
    model, params, x = setup(experts, top_k, mlp, shape=shape, seed=seed,
                             capacity_factor=factor)
    want = capacity_reference(params, x, top_k, factor, mlp)
    torch.testing.assert_close(model.apply(params, x), want, rtol=0, atol=1e-12)


def test_capacity_enough_for_every_token_is_the_dropless_moe():
    model, params, x = setup(experts=4, top_k=2, capacity_factor=2.0)  # C = T: nothing drops
    dropless = torchfn.Model(MoE(8, 12, 4, 2))
    torch.testing.assert_close(model.apply(params, x), dropless.apply(params, x), rtol=0,
                               atol=1e-12)


def test_capacity_under_vmap_and_compile_equals_each_example_alone():
    """Per-sample gradients at sparse cost: vmap over examples, each with its own
    capacity from its own tokens, equals a loop; so does the compiled forward."""
    model, params, x = setup(experts=4, top_k=2, shape=(3, 6), capacity_factor=0.75)

    def loss(p, xi):
        return model.apply(p, xi).square().sum()

    per = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)
    for i, xi in enumerate(x):
        one = torch.func.grad(loss)(params, xi)
        for name in params:
            torch.testing.assert_close(per[name][i], one[name], rtol=0, atol=1e-12)
        torch.testing.assert_close(model.apply(params, xi),
                                   capacity_reference(params, xi, 2, 0.75), rtol=0, atol=1e-12)
    torch._dynamo.reset()
    compiled = torch.compile(lambda p, x: model.apply(p, x), fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(params, x), model.apply(params, x), rtol=0, atol=1e-12)


def test_deepseek_routing_is_the_same_on_both_paths_and_its_load_and_bias_update():
    """Sigmoid scores, group-limited choice, a selection bias and a routed scale: the
    grouped and dense computations agree (vmap takes the dense one); ``expert_load``
    counts the choices; ``moe_bias_update`` is ``b + rate * sign(mean - load)``, and a
    few updates even out a skewed load without a gradient."""
    model, params, x = setup(experts=8, top_k=2, shape=(4, 16), scoring="sigmoid",
                             groups=4, topk_groups=2, routed_scale=1.5, router_bias=True)
    moe = model._eval_skeleton
    state = {"router_bias": torch.linspace(-0.3, 0.3, 8, dtype=torch.float64)}
    sparse = model.apply(params, x, state=state)
    real = _moe._batched_transform_active
    try:
        _moe._batched_transform_active = lambda: True
        dense = model.apply(params, x, state=state)
    finally:
        _moe._batched_transform_active = real
    torch.testing.assert_close(sparse, dense, rtol=0, atol=1e-12)
    logits = x.reshape(-1, 8) @ params["router.weight"].T
    _, chosen = moe.select(logits, state["router_bias"])
    load = moe.expert_load(logits, state["router_bias"])
    assert torch.equal(load, torch.bincount(chosen.reshape(-1), minlength=8).float())
    bias = torch.zeros(8, dtype=torch.float64)
    bias2 = moe_bias_update(bias, load, rate=0.05)
    want = 0.05 * torch.sign(load.mean() - load).double()
    torch.testing.assert_close(bias2, want, rtol=0, atol=0)
    skew = params["router.weight"] + torch.linspace(0, 1, 8, dtype=torch.float64)[:, None]
    logits = x.reshape(-1, 8) @ skew.T  # routing crowds the later experts
    bias = torch.zeros(8, dtype=torch.float64)
    spread = moe.expert_load(logits, bias).std()
    for _ in range(60):
        bias = moe_bias_update(bias, moe.expert_load(logits, bias), rate=0.02)
    assert moe.expert_load(logits, bias).std() < 0.5 * spread


def test_normalize_eps_divides_by_the_sum_plus_it():
    """LFM2-MoE's renormalisation: the chosen scores over their sum plus ``normalize_eps``
    (a large eps here, so that it shows), then the routed scale."""
    moe = MoE(4, 8, 6, 3, scoring="sigmoid", normalize_eps=0.5, routed_scale=2.0)
    logits = torch.randn(5, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    weights, chosen = moe.select(logits)
    picked = logits.sigmoid().gather(-1, chosen)
    torch.testing.assert_close(weights, 2.0 * picked / (picked.sum(-1, keepdim=True) + 0.5),
                               rtol=0, atol=1e-15)
    with pytest.raises(ValueError, match="normalize_eps must be a number >= 0, got -1"):
        MoE(4, 8, 6, normalize_eps=-1)


@pytest.mark.parametrize("top_k", [2, 3])
def test_sparsemixer_routing_equals_its_rule_token_by_token(top_k, path):
    """Phi-3.5-MoE's SparseMixer at inference, written out per token: round r takes the
    best expert left and weighs it by its softmax among the experts left whose logits lie
    within a relative 2 eps of that best; on both paths, and its gradient (through the
    softmaxes) equals the loop's."""
    eps = 0.3  # wide enough that several experts share each softmax
    moe = MoE(8, 12, 6, top_k, scoring="sparsemixer", sparsemixer_eps=eps)
    model = torchfn.Model(moe)
    params = {n: p.double() for n, p in model.init(random.key(5)).items()}
    x = random.normal(random.key(6), (3, 5, 8), torch.float64)

    def by_rule(params, x):
        out = []
        for t in x.reshape(-1, 8):
            logits = params["router.weight"] @ t  # (E,)
            left, acc, shared = logits.clone(), torch.zeros_like(t), 0
            for _ in range(top_k):
                e = int(left.argmax())
                best = left[e]
                near = [j for j in range(6) if left[j] > float("-inf")
                        and (best - logits[j]) / max(abs(logits[j]), best) <= 2 * eps]
                shared += len(near) > 1
                w = torch.softmax(logits[near], 0)[near.index(e)]
                h = torch.nn.functional.silu(params["gate"][e] @ t) * (params["up"][e] @ t)
                acc = acc + w * (params["down"][e] @ h)
                left = left.index_fill(0, torch.tensor([e]), float("-inf"))
            out.append(acc)
        return torch.stack(out).reshape(x.shape), shared

    want, shared = by_rule(params, x)
    assert shared > 0  # the softmaxes are over more than one expert somewhere
    torch.testing.assert_close(model.apply(params, x), want, rtol=0, atol=1e-12)
    grads = torch.func.grad(lambda p: model.apply(p, x).square().sum())(params)
    loop = torch.func.grad(lambda p: by_rule(p, x)[0].square().sum())(params)
    for name in params:
        torch.testing.assert_close(grads[name], loop[name], rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="sparsemixer_eps must be a number >= 0, got -1"):
        MoE(4, 8, 6, scoring="sparsemixer", sparsemixer_eps=-1)
    with pytest.raises(ValueError, match="scoring='sparsemixer' takes neither groups nor "
                                         "router_bias"):
        MoE(4, 8, 6, scoring="sparsemixer", router_bias=True)


def test_an_averaged_shared_expert_is_half_the_sum(path):
    """Cohere2-MoE's ``shared_combine="average"``: ``(routed + shared) / 2``, on both
    paths; any other combination is named."""
    model, params, x = setup(shared_hidden=6, shared_combine="average")
    torch.testing.assert_close(model.apply(params, x), 0.5 * loop_reference(params, x, 2),
                               rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="shared_combine must be 'sum' or 'average', got "
                                         "'max'"):
        MoE(4, 8, 6, shared_hidden=4, shared_combine="max")


def test_layer_experts_mix_dense_and_mixture_blocks():
    """Only the chosen blocks route (their logits, in order, are what
    ``return_router_logits`` gives); the others keep a dense MLP of ``mlp_hidden``."""
    net = TransformerEncoder(16, 2, 3, vocab_size=11, out_dim=11, causal=True, experts=4,
                             top_k=2, mlp="swiglu", mlp_hidden=24, expert_hidden=8,
                             layer_experts=[False, True, False])
    model = torchfn.Model(net)
    params = model.init(random.key(0))
    assert params["blocks.0.mlp.gate.weight"].shape == (24, 16)
    assert params["blocks.1.mlp.gate"].shape == (4, 8, 16)
    tokens = random.randint(random.key(1), (2, 5), 0, 11)
    out, logits = model.apply(params, tokens, return_router_logits=True)
    assert len(logits) == 1 and logits[0].shape == (2, 5, 4)
    torch.testing.assert_close(out, model.apply(params, tokens))
    for bad in ([True], [False, False, False]):
        with pytest.raises(ValueError, match="layer_experts must be a list of depth = 3 bools"):
            TransformerEncoder(16, 2, 3, experts=4, layer_experts=bad)


def test_router_logits_are_the_routers():
    model, params, x = setup()
    out, logits = model.apply(params, x, return_router_logits=True)
    torch.testing.assert_close(logits, x @ params["router.weight"].T, rtol=0, atol=0)
    torch.testing.assert_close(out, model.apply(params, x), rtol=0, atol=0)


def test_load_balance_matches_its_definition_and_closed_forms():
    logits = [random.normal(random.key(i), (2, 6, 5), torch.float64) for i in range(3)]
    mask = random.bernoulli(random.key(7), 0.7, (2, 6))
    # written out: over the kept tokens of all layers, f[s, e] and P[e]
    flat = torch.cat([lg[mask] for lg in logits])  # (M, E)
    probs = flat.softmax(-1)
    chosen = probs.topk(2, dim=-1).indices
    f = torch.stack([(chosen[:, s, None] == torch.arange(5)).double().mean(0)
                     for s in range(2)])  # (k, E)
    want = 5 * (f * probs.mean(0)).sum()
    torch.testing.assert_close(losses.moe_load_balance(logits, 2, mask=mask), want)
    torch.testing.assert_close(losses.moe_load_balance(torch.cat([lg[mask] for lg in logits]),
                                                       2), want)
    # balanced routing gives top_k; one certain expert for every token gives E * top_k
    balanced = torch.eye(4).repeat(3, 1) * 50  # each expert first for 3 of 12 tokens
    torch.testing.assert_close(losses.moe_load_balance(balanced, 1), torch.tensor(1.0))
    certain = torch.tensor([[60.0, 30.0, 0.0, 0.0]]).repeat(8, 1)
    torch.testing.assert_close(losses.moe_load_balance(certain, 2), torch.tensor(4.0),
                               atol=1e-6, rtol=0)
    # the gradient goes through P only: more probability on the loaded expert costs more
    g = torch.func.grad(lambda lg: losses.moe_load_balance(lg, 1))(logits[0])
    busiest = logits[0].argmax(-1).flatten().bincount(minlength=5).argmax()
    assert (g[..., busiest] > 0).float().mean() > 0.5


def test_sequence_balance_matches_a_loop_and_the_pooled_form():
    """DeepSeek-V3's sequence-wise loss equals a loop over the rows of its formula (sigmoid
    scores, the choice with a selection bias, padding masked, an empty row dropped); for
    one row of softmax scores it is the pooled loss over ``top_k``; a batch balanced as a
    whole but not row by row is penalised by it and not by the pooled one; its gradient
    (through ``P``) under vmap equals a loop."""
    logits = [random.normal(random.key(i), (3, 6, 5), torch.float64) for i in range(2)]
    mask = random.bernoulli(random.key(7), 0.7, (3, 6))
    mask[2] = False  # a row of padding alone
    bias = torch.tensor([0.3, -0.2, 0.0, 0.5, -0.1], dtype=torch.float64)
    rows = []
    for lg in logits:
        for b in range(2):
            s = lg[b][mask[b]].sigmoid()  # (T, E)
            top = (s + bias).topk(2, dim=-1).indices
            f = torch.stack([(top == e).any(-1).double().sum() for e in range(5)])
            f = f * 5 / (2 * len(s))
            rows.append((f * (s / s.sum(-1, keepdim=True)).mean(0)).sum())
    got = losses.moe_sequence_balance(logits, 2, bias=bias, mask=mask)
    torch.testing.assert_close(got, torch.stack(rows).mean())
    one = logits[0][:1]
    torch.testing.assert_close(losses.moe_sequence_balance(one, 2, scoring="softmax"),
                               losses.moe_load_balance(one, 2) / 2)
    # rows on experts {0, 1} and {2, 3}: balanced as a batch, not as sequences
    halves = torch.stack([torch.eye(4)[[0, 1, 0, 1]], torch.eye(4)[[2, 3, 2, 3]]]) * 50
    torch.testing.assert_close(losses.moe_load_balance(halves, 1), torch.tensor(1.0))
    torch.testing.assert_close(losses.moe_sequence_balance(halves, 1, scoring="softmax"),
                               torch.tensor(2.0))
    per = torch.func.vmap(torch.func.grad(
        lambda lg: losses.moe_sequence_balance(lg[None], 2)))(logits[0])
    for b in range(3):
        want = torch.func.grad(lambda lg: losses.moe_sequence_balance(lg[None], 2))(logits[0][b])
        torch.testing.assert_close(per[b], want)


def test_router_z_loss_matches_its_definition():
    logits = random.normal(random.key(3), (4, 7, 6), torch.float64) * 3
    mask = random.bernoulli(random.key(4), 0.5, (4, 7))
    want = logits[mask].logsumexp(-1).square().mean()
    torch.testing.assert_close(losses.router_z_loss(logits, mask=mask), want)
    torch.testing.assert_close(losses.router_z_loss([logits, logits]),
                               logits.logsumexp(-1).square().mean())


def test_moe_transformer_returns_router_logits_and_caches():
    module = TransformerEncoder(16, 2, 2, vocab_size=20, out_dim=20, causal=True, experts=4,
                                top_k=2, mlp="swiglu", position_embedding="rotary")
    model = torchfn.Model(module)
    params = {n: p.double() for n, p in model.init(random.key(0)).items()}
    tokens = random.randint(random.key(1), (2, 9), 0, 20)
    out, logits = model.apply(params, tokens, return_router_logits=True)
    assert len(logits) == 2 and all(lg.shape == (2, 9, 4) for lg in logits)
    torch.testing.assert_close(out, model.apply(params, tokens), rtol=0, atol=0)
    one, one_logits = model.apply(params, tokens[1], return_router_logits=True)  # (N,)
    torch.testing.assert_close(one_logits[1], logits[1][1], rtol=0, atol=1e-12)
    torch.testing.assert_close(one, out[1], rtol=0, atol=1e-12)
    first, cache = model.apply(params, tokens[:, :5], cache=KVCache())
    rest, _ = model.apply(params, tokens[:, 5:], cache=cache)
    torch.testing.assert_close(torch.cat((first, rest), 1), out, rtol=0, atol=1e-12)
    # remat recomputes the blocks: same loss and gradients, the aux loss included
    remat = torchfn.Model(TransformerEncoder(16, 2, 2, vocab_size=20, out_dim=20,
                                             causal=True, experts=4, top_k=2, mlp="swiglu",
                                             position_embedding="rotary", remat=True))

    def loss(m):
        def f(p):
            out, logits = m.apply(p, tokens, return_router_logits=True)
            return losses.cross_entropy(out, tokens) + 0.02 * losses.moe_load_balance(
                logits, 2)
        return f

    g, g_remat = torch.func.grad(loss(model))(params), torch.func.grad(loss(remat))(params)
    for name in params:
        torch.testing.assert_close(g_remat[name], g[name], rtol=0, atol=1e-12)
    assert g["blocks.0.mlp.router.weight"].abs().sum() > 0


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="top_k must be <= experts = 4, got top_k=5"):
        MoE(8, 16, 4, 5)
    with pytest.raises(ValueError, match="experts must be an int >= 1, got 0"):
        MoE(8, 16, 0)
    with pytest.raises(ValueError, match="shared_gate needs shared_hidden"):
        MoE(8, 16, 4, shared_gate=True)
    with pytest.raises(ValueError, match="moe_options need experts"):
        TransformerEncoder(8, 2, 1, moe_options={"shared_hidden": 4})
    with pytest.raises(ValueError, match="mlp must be 'swiglu', 'gelu', 'relu2' or 'swiglu_clamp', "
                                         "got 'relu'"):
        MoE(8, 16, 4, mlp="relu")
    for bad in (0, -1.0, True):
        with pytest.raises(ValueError, match="capacity_factor must be a number > 0 or None"):
            MoE(8, 16, 4, capacity_factor=bad)
    with pytest.raises(ValueError, match="scoring must be 'softmax', 'sigmoid' or "
                                         "'sparsemixer', got 'relu'"):
        MoE(8, 16, 4, scoring="relu")
    with pytest.raises(ValueError, match="give groups and topk_groups together"):
        MoE(8, 16, 4, groups=2)
    with pytest.raises(ValueError, match="groups must divide experts = 6 into groups of >= 2"):
        MoE(8, 16, 6, groups=4, topk_groups=1)
    with pytest.raises(ValueError, match=r"bias and load must be tensors \(E,\) of one shape"):
        moe_bias_update(torch.zeros(4), torch.zeros(3))
    model, params, _ = setup()
    with pytest.raises(ValueError, match=r"x must end in dim = 8, got shape \(2, 7\)"):
        model.apply(params, torch.ones(2, 7, dtype=torch.float64))
    plain = torchfn.Model(TransformerEncoder(8, 2, 1, vocab_size=5, causal=True))
    with pytest.raises(ValueError, match="return_router_logits needs experts"):
        plain.apply(plain.init(random.key(0)), torch.zeros(1, 3, dtype=torch.long),
                    return_router_logits=True)
    with pytest.raises(ValueError, match=r"top_k must be <= the 4 experts, got 5"):
        losses.moe_load_balance(torch.zeros(3, 4), 5)
    with pytest.raises(ValueError, match="one shape"):
        losses.router_z_loss([torch.zeros(3, 4), torch.zeros(2, 4)])
    with pytest.raises(ValueError, match=r"mask must be a tensor of the tokens' shape \(3,\)"):
        losses.router_z_loss(torch.zeros(3, 4), mask=torch.ones(4, dtype=torch.bool))
    with pytest.raises(TypeError, match="router_logits must be a float tensor"):
        losses.moe_load_balance(torch.zeros(3, 4, dtype=torch.long), 1)
    with pytest.raises(ValueError, match="scoring must be 'sigmoid' or 'softmax', got 'relu'"):
        losses.moe_sequence_balance(torch.zeros(2, 3, 4), 1, scoring="relu")
    with pytest.raises(ValueError, match=r"router_logits must be \(B, T, E\) a layer, got "
                                         r"\(3, 4\)"):
        losses.moe_sequence_balance(torch.zeros(3, 4), 1)
    with pytest.raises(ValueError, match=r"bias must be a tensor \(4,\), got torch.Size"):
        losses.moe_sequence_balance(torch.zeros(2, 3, 4), 1, bias=torch.zeros(3))
    with pytest.raises(ValueError, match="top_k must be an int >= 1, got 0"):
        losses.moe_sequence_balance(torch.zeros(2, 3, 4), 0)


@pytest.mark.parametrize("how", ["sparse", "dense", "capacity"])
def test_gpt_oss_experts_equal_their_formula_on_every_path(how, monkeypatch):
    """gpt-oss's experts (``swiglu_clamp`` with biases, a biased router, softmax over the
    top-k logits) against the formula token by token, on the sparse path, the dense one
    (``vmap`` / compile) and with ample capacity; the clamp is low enough to bite."""
    limit, alpha = 0.4, 1.702
    moe = MoE(8, 12, 4, 2, mlp="swiglu_clamp", expert_bias=True, logit_bias=True,
              swiglu_limit=limit, swiglu_alpha=alpha,
              capacity_factor=4.0 if how == "capacity" else None)
    model = torchfn.Model(moe)
    params = {n: p.double() for n, p in model.init(random.key(3)).items()}
    assert {"router.bias", "up_bias", "gate_bias", "down_bias"} <= set(params)
    x = random.normal(random.key(4), (3, 5, 8), torch.float64)
    if how == "dense":
        monkeypatch.setattr(_moe, "_batched_transform_active", lambda: True)
    want = []
    for t in x.reshape(-1, 8):
        logits = params["router.weight"] @ t + params["router.bias"]
        top, chosen = logits.topk(2)
        acc = torch.zeros_like(t)
        for w, e in zip(top.softmax(-1), chosen):
            g = (params["gate"][e] @ t + params["gate_bias"][e]).clamp(max=limit)
            u = (params["up"][e] @ t + params["up_bias"][e]).clamp(-limit, limit)
            h = (u + 1) * g * torch.sigmoid(alpha * g)
            acc = acc + w * (params["down"][e] @ h + params["down_bias"][e])
        want.append(acc)
    torch.testing.assert_close(model.apply(params, x), torch.stack(want).reshape(x.shape),
                               rtol=0, atol=1e-12)


def test_a_wider_router_computes_the_logits_in_its_dtype_with_its_bias():
    """A float32 router (and its logit bias) on bfloat16 tokens, as transformers keeps
    DeepSeek-V3's and gpt-oss's routers: the logits are the float32 ones of the float32
    tokens, bias included."""
    moe = MoE(8, 12, 4, 2, logit_bias=True)
    model = torchfn.Model(moe)
    params = model.init(random.key(5))
    x = random.normal(random.key(6), (5, 8)).to(torch.bfloat16)
    low = {n: t if n.startswith("router") else t.to(torch.bfloat16) for n, t in params.items()}
    logits = model.apply(low, x, return_router_logits=True)[1]
    want = x.float() @ params["router.weight"].T + params["router.bias"]
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, want, rtol=0, atol=0)


@pytest.mark.parametrize("how", ["sparse", "dense", "capacity"])
@pytest.mark.parametrize("expert_bias", [False, True])
def test_weights_on_the_input_equal_their_formula_on_every_path(how, expert_bias, monkeypatch):
    """``weights_on="input"`` (Llama 4): ``sum_e f_e(w_e x)`` over the chosen experts, with
    sigmoid scores, un-renormalised, plus the shared expert; on the sparse path, the dense
    one (``vmap`` / compile: the unchosen experts, whose biased output at 0 is not 0, must
    add nothing) and with ample capacity. Weighting the output instead fails it."""
    moe = MoE(8, 12, 4, 2, scoring="sigmoid", normalize=False, weights_on="input",
              expert_bias=expert_bias, shared_hidden=None if expert_bias else 6,
              capacity_factor=4.0 if how == "capacity" else None)
    model = torchfn.Model(moe)
    params = {n: p.double() for n, p in model.init(random.key(7)).items()}
    x = random.normal(random.key(8), (3, 5, 8), torch.float64)
    if how == "dense":
        monkeypatch.setattr(_moe, "_batched_transform_active", lambda: True)
    b = (lambda n, e: params[n][e]) if expert_bias else (lambda n, e: 0.0)
    want = []
    for t in x.reshape(-1, 8):
        top, chosen = (params["router.weight"] @ t).sigmoid().topk(2)
        acc = torch.zeros_like(t)
        for w, e in zip(top, chosen):
            u = w * t  # the weight scales what the expert reads
            h = torch.nn.functional.silu(params["gate"][e] @ u + b("gate_bias", e)) * (
                params["up"][e] @ u + b("up_bias", e))
            acc = acc + params["down"][e] @ h + b("down_bias", e)
        if not expert_bias:
            acc = acc + params["shared.down.weight"] @ (torch.nn.functional.silu(
                params["shared.gate.weight"] @ t) * (params["shared.up.weight"] @ t))
        want.append(acc)
    torch.testing.assert_close(model.apply(params, x), torch.stack(want).reshape(x.shape),
                               rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="weights_on must be 'output' or 'input', got 'in'"):
        MoE(8, 12, 4, weights_on="in")

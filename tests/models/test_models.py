"""Model zoo: torchfn.Model(module).apply equals the module's forward (same tensors),
gradients equal loss.backward(), BatchNorm state equals the module's updated buffers,
per-example vmap equals the batch, the fused attention equals SDPA."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import torchfn
from torchfn import random
from torchfn.models import MLP, MLPVAE, ConvNet, ResNet, TransformerEncoder


def keyed(module, seed=0):
    """Load parameters drawn from a torchfn key into the module (no global RNG)."""
    model = torchfn.Model(module)
    module.load_state_dict(model.state_dict(model.init(random.key(seed)), model.init_state()))
    return module


def check_apply_and_grads(module, *inputs, state=False, rtol=1e-5, atol=1e-6, **kwargs):
    """apply == forward and grad(apply) == backward, using the module's own tensors."""
    model = torchfn.Model(module)
    params, mstate = model.extract(module)
    module.eval()
    out = model.apply(params, *inputs, state=mstate if state else None, **kwargs)
    torch.testing.assert_close(out, module(*inputs, **kwargs), rtol=rtol, atol=atol)

    def loss(p):
        return model.apply(p, *inputs, state=mstate if state else None, **kwargs).square().mean()

    grads = torch.func.grad(loss)(params)
    module.zero_grad()
    module(*inputs, **kwargs).square().mean().backward()
    for name, p in module.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=rtol, atol=atol)
    return model, params


@given(seed=st.integers(0, 2**16), hidden=st.sampled_from([(), (5,), (4, 6)]),
       act=st.sampled_from(["relu", "gelu", "silu", "tanh"]),
       lead=st.sampled_from([(), (3,), (2, 3)]))
def test_mlp_apply_and_grads_equal_module(seed, hidden, act, lead):
    module = keyed(MLP(4, hidden, 2, activation=act), seed)
    x = torch.randn(*lead, 4, generator=torch.Generator().manual_seed(seed))
    check_apply_and_grads(module, x)


def test_mlp_init_loads_into_module_and_dropout_is_keyed():
    module = MLP(3, (16,), 2, dropout=0.5)
    model = torchfn.Model(module)
    params = model.init(random.key(0))
    module.load_state_dict(model.state_dict(params, {}))
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    module.eval()
    torch.testing.assert_close(model.apply(params, x), module(x))
    a, _ = model.apply(params, x, key=random.key(1), train=True)
    b, _ = model.apply(params, x, key=random.key(1), train=True)
    c, _ = model.apply(params, x, key=random.key(2), train=True)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_convnet_apply_grads_and_per_example_vmap():
    module = keyed(ConvNet(2, 5, channels=(4, 6)))
    x = torch.randn(3, 2, 8, 8, generator=torch.Generator().manual_seed(1))
    model, params = check_apply_and_grads(module, x)
    per = torch.func.vmap(lambda xi: model.apply(params, xi))(x)
    torch.testing.assert_close(per, model.apply(params, x), rtol=1e-5, atol=1e-6)


def test_resnet_batchnorm_state_and_grads_equal_module():
    module = keyed(ResNet(3, 4, widths=(4, 8), blocks_per_stage=1))
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    model = torchfn.Model(module)
    params, state = model.extract(module)
    assert any("running_mean" in n for n in state)
    out, new_state = model.apply(params, x, state=state, train=True)
    module.train()
    ref = module(x)  # updates the module's running statistics in place
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for name, buf in module.named_buffers():
        torch.testing.assert_close(new_state[name], buf, rtol=1e-5, atol=1e-6)
        if "running_mean" in name:
            assert not torch.equal(new_state[name], state[name])  # it moved; input untouched
    module.load_state_dict(model.state_dict(params, new_state))
    check_apply_and_grads(module, x, state=True, rtol=1e-4, atol=1e-5)
    single = model.apply(params, x[0], state=new_state)  # one example, eval mode
    torch.testing.assert_close(single, model.apply(params, x, state=new_state)[0], rtol=1e-5,
                               atol=1e-5)


def sdpa(q, k, v, *, key_padding_mask=None, causal=False):
    """The reference attention: torch's SDPA on the same (B, H, N, D) tensors."""
    mask = None if key_padding_mask is None else key_padding_mask[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)


@pytest.mark.parametrize("causal", [False, True])
def test_transformer_apply_grads_and_fused_attention_equal_sdpa(causal):
    kw = dict(dim=16, heads=2, depth=2, vocab_size=11, out_dim=11, causal=causal, max_len=8)
    module = keyed(TransformerEncoder(**kw))
    tokens = torch.randint(0, 11, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, 5:] = False  # padding at the end of the second sequence
    model, params = check_apply_and_grads(module, tokens, key_padding_mask=mask, rtol=1e-4,
                                          atol=1e-5)
    reference = torchfn.Model(TransformerEncoder(**kw, attend=sdpa))
    torch.testing.assert_close(model.apply(params, tokens, key_padding_mask=mask),
                               reference.apply(params, tokens, key_padding_mask=mask),
                               rtol=1e-5, atol=1e-5)
    per = torch.func.vmap(lambda t: model.apply(params, t))(tokens)
    torch.testing.assert_close(per, model.apply(params, tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("positions", ["learned", "rotary"])
def test_packed_documents_give_each_document_its_own_output(positions):
    """Two documents packed into one sequence with ``segment_ids`` == each run alone
    (attention within the document, positions restarting at 0), and their gradients
    add up to the sum of the separate runs'."""
    model = torchfn.Model(TransformerEncoder(dim=16, heads=2, depth=2, vocab_size=11,
                                             out_dim=11, causal=True, max_len=12,
                                             position_embedding=positions))
    params = model.init(random.key(3))
    g = torch.Generator().manual_seed(2)
    a, b = torch.randint(0, 11, (5,), generator=g), torch.randint(0, 11, (7,), generator=g)
    packed = torch.cat([a, b])[None]  # (1, 12)
    ids = torch.tensor([[0] * 5 + [1] * 7])
    out = model.apply(params, packed, segment_ids=ids)[0]
    torch.testing.assert_close(out[:5], model.apply(params, a), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[5:], model.apply(params, b), rtol=1e-5, atol=1e-5)
    # one example (no batch dim) takes (N,) ids, for per-example vmap
    torch.testing.assert_close(model.apply(params, packed[0], segment_ids=ids[0]), out)
    loss = lambda p, *x, **kw: model.apply(p, *x, **kw).square().mean()  # noqa: E731
    g_packed = torch.func.grad(lambda p: loss(p, packed, segment_ids=ids) * 12)(params)
    g_a = torch.func.grad(lambda p: loss(p, a) * 5)(params)
    g_b = torch.func.grad(lambda p: loss(p, b) * 7)(params)
    for n in params:
        torch.testing.assert_close(g_packed[n], g_a[n] + g_b[n], rtol=1e-4, atol=1e-5)


def test_sliding_window_transformer_equals_a_band_mask():
    from torchfn.kernels import attention

    kw = dict(dim=16, heads=2, depth=1, vocab_size=11, causal=True, max_len=9)
    model = torchfn.Model(TransformerEncoder(**kw, window=(2, None)))
    params = model.init(random.key(4))
    band = torch.ones(9, 9, dtype=torch.bool).tril() & torch.ones(9, 9, dtype=torch.bool).triu(-2)

    def banded(q, k, v, *, key_padding_mask, causal):
        return attention(q, k, v, mask=band, key_padding_mask=key_padding_mask)

    reference = torchfn.Model(TransformerEncoder(**kw, attend=banded))
    tokens = torch.randint(0, 11, (2, 9), generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(model.apply(params, tokens), reference.apply(params, tokens))
    assert not torch.allclose(model.apply(params, tokens),
                              torchfn.Model(TransformerEncoder(**kw)).apply(params, tokens))
    # softcap reaches the kernel the same way
    capped = torchfn.Model(TransformerEncoder(**kw, softcap=0.5))

    def capped_attend(q, k, v, *, key_padding_mask, causal):
        return attention(q, k, v, key_padding_mask=key_padding_mask, causal=causal, softcap=0.5)

    torch.testing.assert_close(
        capped.apply(params, tokens),
        torchfn.Model(TransformerEncoder(**kw, attend=capped_attend)).apply(params, tokens))


def test_transformer_on_features_and_keyed_dropout():
    model = torchfn.Model(TransformerEncoder(dim=8, heads=2, depth=1, in_dim=3, dropout=0.1))
    params = model.init(random.key(0))
    x = torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(0))
    assert model.apply(params, x).shape == (2, 5, 8)
    a, _ = model.apply(params, x, key=random.key(1), train=True)
    b, _ = model.apply(params, x, key=random.key(1), train=True)
    assert torch.equal(a, b) and not torch.equal(a, model.apply(params, x))


def test_attention_dropout_is_keyed_by_apply_and_reaches_the_kernel():
    """attn_dropout: the i-th stochastic call of apply passes ``fold_in(key, i)`` to the
    fused kernel (train mode only); vmap over keys == a loop; outside apply: an error."""
    from torchfn.kernels import attention

    kw = dict(dim=16, heads=2, depth=2, vocab_size=11, causal=True, max_len=9)
    model = torchfn.Model(TransformerEncoder(**kw, attn_dropout=0.3))
    params = model.init(random.key(4))
    tokens = torch.randint(0, 11, (2, 9), generator=torch.Generator().manual_seed(5))
    key = random.key(8)
    calls = []

    def by_hand(q, k, v, *, key_padding_mask, causal):
        kk = random.fold_in(key, len(calls))  # the blocks' calls, in order
        calls.append(kk)
        return attention(q, k, v, key_padding_mask=key_padding_mask, causal=causal,
                         dropout=0.3, key=kk)

    out, _ = model.apply(params, tokens, key=key, train=True)
    want, _ = torchfn.Model(TransformerEncoder(**kw, attend=by_hand)).apply(
        params, tokens, key=key, train=True)
    assert len(calls) == 2
    torch.testing.assert_close(out, want)
    plain = model.apply(params, tokens)  # eval: no attention dropout, no key needed
    assert not torch.allclose(out, plain)
    torch.testing.assert_close(plain, torchfn.Model(TransformerEncoder(**kw)).apply(params, tokens))
    keys = random.split(key, 3)
    batched = torch.func.vmap(lambda k: model.apply(params, tokens, key=k, train=True)[0])(keys)
    for i in range(3):
        torch.testing.assert_close(batched[i], model.apply(params, tokens, key=keys[i],
                                                           train=True)[0])
    with pytest.raises(ValueError, match="key: the module runs attention dropout"):
        model.apply(params, tokens, train=True)
    with pytest.raises(ValueError, match=r"attention dropout needs randomness: run the module"):
        TransformerEncoder(**kw, attn_dropout=0.3)(tokens)
    with pytest.raises(ValueError, match=r"attn_dropout must be in \[0, 1\), got 1.0"):
        TransformerEncoder(**kw, attn_dropout=1.0)


def test_mlpvae_encode_decode_equal_module():
    module = keyed(MLPVAE(6, (8,), 2))
    model = torchfn.Model(module)
    params, _ = model.extract(module)
    x = torch.rand(3, 6, generator=torch.Generator().manual_seed(0))
    mean, logvar = model.apply(params, x)
    ref_mean, ref_logvar = module.encode(x)
    torch.testing.assert_close(mean, ref_mean)
    torch.testing.assert_close(logvar, ref_logvar)
    torch.testing.assert_close(model.apply(params, z=mean), module.decode(mean))
    assert mean.shape == (3, 2) and model.apply(params, z=mean).shape == (3, 6)


def test_bad_input():
    with pytest.raises(ValueError, match="activation must be one of"):
        MLP(2, (3,), 1, activation="swishy")
    with pytest.raises(TypeError, match="hidden must be a sequence of widths"):
        MLP(2, 3, 1)
    with pytest.raises(ValueError, match=r"hidden\[1\] must be an int >= 1, got 0"):
        MLP(2, (3, 0), 1)
    with pytest.raises(ValueError, match="dropout must be in \\[0, 1\\), got 1.0"):
        MLP(2, (3,), 1, dropout=1.0)
    with pytest.raises(ValueError, match="channels must be a non-empty sequence"):
        ConvNet(1, 10, channels=())
    with pytest.raises(ValueError, match="dim must be divisible by heads, got dim=10, heads=3"):
        TransformerEncoder(dim=10, heads=3, depth=1)
    with pytest.raises(ValueError, match="give vocab_size .* or in_dim .*, not both"):
        TransformerEncoder(dim=8, heads=2, depth=1, vocab_size=5, in_dim=3)
    enc = TransformerEncoder(dim=8, heads=2, depth=1, vocab_size=5, max_len=4)
    with pytest.raises(ValueError, match="sequence length 6 exceeds max_len=4"):
        enc(torch.zeros(1, 6, dtype=torch.long))
    with pytest.raises(ValueError, match=r"segment_ids must have shape \(B, N\) = \(2, 3\), "
                                         r"got \(2, 4\)"):
        enc(torch.zeros(2, 3, dtype=torch.long), segment_ids=torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="pass exactly one of x"):
        MLPVAE(4, (3,), 2)()

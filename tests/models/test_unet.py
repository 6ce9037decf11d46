"""UNet: DDPM's noise-prediction U-Net; one example equals its row of the batch, under
every transform."""

import pytest
import torch
from torch.func import grad, jacrev, jvp, vmap

import torchfn
from torchfn import random
from torchfn.models import UNet

CONFIGS = {
    "small": dict(in_channels=1, channels=8, mults=(1, 2)),
    "deep": dict(in_channels=3, channels=8, mults=(1, 2, 2), blocks=2, attention=(0, 2),
                 heads=2, num_classes=3),
}


def _model(name, dtype=torch.float32, **extra):
    """A model and params moved off the zero output layer (an untrained UNet predicts 0)."""
    model = torchfn.Model(UNet(**{**CONFIGS[name], **extra}).to(dtype))
    params = model.init(random.key(0))
    keys = random.split(random.key(1), len(params))
    params = {k: v + 0.1 * random.normal(keys[i], v.shape, v.dtype)
              for i, (k, v) in enumerate(sorted(params.items()))}
    return model, params


def _batch(name, B=3, dtype=torch.float32):
    C = CONFIGS[name]["in_channels"]
    x = random.normal(random.key(2), (B, C, 8, 8), dtype)
    t = random.randint(random.key(3), (B,), 0, 1000)
    y = random.randint(random.key(4), (B,), 0, 3) if "num_classes" in CONFIGS[name] else None
    return x, t, y


def _args(x, t, y):
    return (x, t) if y is None else (x, t, y)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_untrained_model_predicts_zero(name):
    model = torchfn.Model(UNet(**CONFIGS[name]))
    params = model.init(random.key(0))
    x, t, y = _batch(name)
    out = model.apply(params, *_args(x, t, y))
    assert out.shape == x.shape and not out.any()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_one_example_and_vmap_equal_the_batch(name):
    model, params = _model(name)
    x, t, y = _batch(name)
    batch = model.apply(params, *_args(x, t, y))
    assert batch.abs().max() > 0.1
    mapped = vmap(lambda *a: model.apply(params, *a))(*_args(x, t, y))
    assert torch.allclose(mapped, batch, atol=1e-5)
    for b in range(3):
        one = model.apply(params, *_args(x[b], t[b], None if y is None else y[b]))
        assert torch.allclose(one, batch[b], atol=1e-5)


def test_per_sample_grads_equal_a_loop():
    model, params = _model("small")
    x, t, _ = _batch("small")
    eps = random.normal(random.key(5), x.shape)

    def loss(p, x, t, eps):  # ONE image
        return (model.apply(p, x, t) - eps).pow(2).mean()

    per = vmap(grad(loss), in_dims=(None, 0, 0, 0))(params, x, t, eps)
    for b in range(3):
        g = grad(loss)(params, x[b], t[b], eps[b])
        assert all(torch.allclose(per[k][b], g[k], atol=1e-5) for k in g)


def test_attention_block_is_softmax_attention_over_positions():
    from torchfn.models._unet import _AttnBlock

    block = _AttnBlock(8, heads=2, groups=4).double()
    x = random.normal(random.key(0), (2, 8, 4, 4), torch.float64)
    qkv = block.qkv(block.norm(x)).reshape(2, 3, 2, 4, 16)  # (B, qkv, heads, d, HW)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    p = torch.softmax(q.transpose(-1, -2) @ k / 2.0, dim=-1)  # (B, heads, HW, HW), d**-0.5
    o = (p @ v.transpose(-1, -2)).transpose(-1, -2).reshape(2, 8, 4, 4)
    assert torch.allclose(block(x), x + block.out(o), atol=1e-12)


def test_time_and_class_change_the_output():
    model, params = _model("deep")
    x, t, y = _batch("deep")
    out = model.apply(params, x, t, y)
    assert not torch.allclose(model.apply(params, x, t + 1, y), out, atol=1e-4)
    assert not torch.allclose(model.apply(params, x, t, (y + 1) % 3), out, atol=1e-4)


def test_jvp_equals_the_jacobian_product():
    model, params = _model("small", torch.float64)
    x, t, _ = _batch("small", B=1, dtype=torch.float64)
    f = lambda x: model.apply(params, x, t[0])  # noqa: E731  one image (1, 8, 8)
    dx = random.normal(random.key(6), x[0].shape, torch.float64)
    _, out_t = jvp(f, (x[0],), (dx,))
    J = jacrev(f)(x[0])  # (1, 8, 8, 1, 8, 8)
    assert torch.allclose(out_t, (J * dx).sum((-3, -2, -1)), atol=1e-10)


# What is the model's own: dynamo traces it whole and AOT autograd's graph gives eager's
# values; the default run checks that with aot_eager. Inductor's C++ build of the
# convolutions and norms (about 40 s cold on 2 cores) is inductor's, kept for -m slow.
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_equals_eager(backend):
    model, params = _model("small")
    x, t, _ = _batch("small")
    f = lambda p, x, t: model.apply(p, x, t)  # noqa: E731
    compiled = torch.compile(f, backend=backend, fullgraph=True)
    assert torch.allclose(compiled(params, x, t), f(params, x, t), atol=1e-5)


def test_dropout_is_keyed():
    model, params = _model("small", dropout=0.3)
    x, t, _ = _batch("small")
    run = lambda k: model.apply(params, x, t, key=k, train=True)[0]  # noqa: E731  (out, state)
    assert torch.equal(run(random.key(7)), run(random.key(7)))
    assert not torch.equal(run(random.key(7)), run(random.key(8)))


@pytest.mark.parametrize(
    "kwargs, args, match",
    [
        (dict(in_channels=1, mults=(1, 2, 2)), (torch.zeros(1, 1, 6, 8), torch.zeros(1)),
         r"H and W divisible by 4, got shape \(1, 1, 6, 8\)"),
        (dict(in_channels=3), (torch.zeros(2, 1, 8, 8), torch.zeros(2)),
         r"x must be \(B, 3, H, W\)"),
        (dict(in_channels=1), (torch.zeros(2, 1, 8, 8), torch.zeros(3)),
         r"t must have shape \(2,\) \(one step per image\), got \(3,\)"),
        (dict(in_channels=1, num_classes=3), (torch.zeros(2, 1, 8, 8), torch.zeros(2)),
         "pass the class y exactly when num_classes is set"),
        (dict(in_channels=1, num_classes=3),
         (torch.zeros(2, 1, 8, 8), torch.zeros(2), torch.zeros(2)),
         r"y must be an integer tensor of shape \(2,\)"),
        (dict(in_channels=1, channels=12), (), "width 12 is not divisible by groups=8"),
        (dict(in_channels=1, heads=3), (), "width 32 is not divisible by heads=3"),
        (dict(in_channels=1, attention=(2,)), (), r"attention must list levels in \[0, 2\)"),
        (dict(in_channels=1, mults=()), (), "mults must be ints >= 1"),
        (dict(in_channels=0), (), "in_channels must be an int >= 1, got 0"),
    ],
)
def test_bad_input_gets_a_clear_error(kwargs, args, match):
    with pytest.raises(ValueError, match=match):
        UNet(**kwargs)(*args)

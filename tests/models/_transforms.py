"""A layer's check under the transforms: per-sample gradients and forward-mode AD."""

import torch

from torchfn import random


def check_vmap_grad_and_jvp(model, params, x, eps=1e-6):
    """``vmap(grad)`` of ``model.apply(p, x_i).square().mean()`` equals a loop of
    ``grad``, one example at a time; ``jvp`` in ``x`` equals a central difference with
    step ``eps``. Returns the per-sample gradients."""
    def loss(p, xi):
        return model.apply(p, xi[None]).square().mean()

    per = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)
    for i in range(x.shape[0]):
        one = torch.func.grad(loss)(params, x[i])
        for name in params:
            torch.testing.assert_close(per[name][i], one[name], rtol=1e-10, atol=1e-12)
    v = random.normal(random.key(9), x.shape, dtype=x.dtype)
    _, tangent = torch.func.jvp(lambda y: model.apply(params, y), (x,), (v,))
    diff = (model.apply(params, x + eps * v) - model.apply(params, x - eps * v)) / (2 * eps)
    torch.testing.assert_close(tangent, diff, rtol=1e-6, atol=1e-7)
    return per

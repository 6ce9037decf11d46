"""The MAML example: meta-loss falls, and its meta-gradient through torchopt's
differentiable updates equals a hand-unrolled inner loop and finite differences."""

import importlib.util
from pathlib import Path

import pytest
import torch

from torchfn import random

_PATH = Path(__file__).resolve().parents[2] / "examples" / "maml_sine.py"


@pytest.fixture(scope="module")
def maml():
    spec = importlib.util.spec_from_file_location("maml_sine", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def one_thread():
    """Tiny models run fastest (and steadiest on a loaded machine) on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_meta_loss_decreases(maml, one_thread):
    losses = maml.train(steps=120, meta_batch=5, k_shot=5, outer_lr=1e-2, verbose=False)
    first, last = sum(losses[:20]) / 20, sum(losses[-20:]) / 20
    assert last < 0.8 * first, (first, last)


def _small_case(maml):
    key = random.key(3)
    params = maml.init_mlp(random.fold_in(key, 0), sizes=(1, 8, 8, 1), dtype=torch.float64)
    tasks = maml.sample_tasks(random.fold_in(key, 1), 3, 4, 5, dtype=torch.float64)
    return params, tasks


def test_meta_gradient_equals_hand_unrolled_sgd(maml, one_thread):
    params, tasks = _small_case(maml)
    lr, steps = 0.05, 2
    grads, _ = maml.meta_grad(params, tasks, maml.make_inner("sgd", lr), steps)

    def single(p, x, y):  # one task, shared params
        return maml.task_losses({k: v.unsqueeze(0) for k, v in p.items()}, x[None], y[None])[0]

    def manual_meta_loss(p):
        xs, ys, xq, yq = tasks
        total = 0.0
        for t in range(xs.shape[0]):
            q = p
            for _ in range(steps):  # theta' = theta - lr * grad, written out by hand
                g = torch.func.grad(single)(q, xs[t], ys[t])
                q = {k: q[k] - lr * g[k] for k in q}
            total = total + single(q, xq[t], yq[t])
        return total / xs.shape[0]

    manual = torch.func.grad(manual_meta_loss)(params)
    for k in params:
        torch.testing.assert_close(grads[k], manual[k], rtol=1e-10, atol=1e-12)
    # and it is not the first-order (no second derivative) approximation
    first_order = torch.func.grad(lambda p: single(p, tasks[2][0], tasks[3][0]))(params)
    assert not torch.allclose(grads["w0"], first_order["w0"])


def test_meta_gradient_through_adam_equals_finite_differences(maml, one_thread):
    params, tasks = _small_case(maml)
    inner = maml.make_inner("adam", 0.01)
    grads, _ = maml.meta_grad(params, tasks, inner, 2)
    gen = torch.Generator().manual_seed(0)
    direction = {k: torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in params.items()}
    eps = 1e-6

    def loss_at(s):
        p = {k: (params[k] + s * direction[k]).requires_grad_(True) for k in params}
        return float(maml.meta_loss(p, tasks, inner, 2).detach())

    fd = (loss_at(eps) - loss_at(-eps)) / (2 * eps)
    analytic = sum(float((grads[k] * direction[k]).sum()) for k in params)
    assert analytic == pytest.approx(fd, rel=1e-5, abs=1e-8)

"""``update`` compiles with ``fullgraph=True`` (no graph breaks) and matches eager.

Two compiled cases keep the suite fast: Adam on a dict with inductor, and one
composite chain holding every optimizer and wrapper, traced with the "eager"
backend (graph breaks are a Dynamo property, independent of the backend).
"""

import torch
from _optim_problem import assert_trees_close, grads_at, make_data

from torchfn import optim


def _run(tx, params, grads_seq, compile_kwargs=None):
    update = tx.update
    if compile_kwargs is not None:
        update = torch.compile(tx.update, fullgraph=True, **compile_kwargs)
    state = tx.init(params)
    for grads in grads_seq:
        updates, state = update(grads, state, params)
        params = optim.apply_updates(params, updates)
    return params, state


def test_adam_on_dict_compiles_with_inductor():
    params, xs, ys = make_data(steps=3)
    grads_seq = [grads_at(params, xs[t], ys[t]) for t in range(3)]
    tx = optim.adamw(optim.cosine_annealing(1e-2, 10), weight_decay=0.01)
    torch._dynamo.reset()
    eager = _run(tx, params, grads_seq)
    compiled = _run(tx, params, grads_seq, {"dynamic": False})
    assert_trees_close(compiled, eager, rtol=1e-6, atol=1e-7)


def test_composite_chain_with_every_optimizer_compiles_fullgraph():
    gen = torch.Generator().manual_seed(0)
    shapes = {"adamw": (5, 4), "bias": (4,), "rmsprop": (3, 2), "sgd": (6,), "adagrad": (2, 2),
              "lion": (3,)}
    params = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    grads_seq = [{k: torch.randn(s, generator=gen) for k, s in shapes.items()} for _ in range(4)]
    labels = {k: ("adamw" if k == "bias" else k) for k in shapes}
    tx = optim.chain(
        optim.clip_by_global_norm(1.0),
        optim.apply_if_finite(
            optim.multi_steps(
                optim.partition(
                    {
                        "adamw": optim.inject_hyperparams(optim.adamw, static_args=("mask",))(
                            lr=optim.warmup_cosine(1e-2, 1, 10), weight_decay=0.1,
                            mask=optim.decay_mask,
                        ),
                        "rmsprop": optim.rmsprop(1e-2, momentum=0.5, centered=True),
                        "sgd": optim.chain(
                            optim.sgd(0.1, momentum=0.9, dampening=0.1, weight_decay=0.1),
                            optim.ema(0.5),
                        ),
                        "adagrad": optim.adagrad(0.1, lr_decay=0.1),
                        "lion": optim.lion(1e-3, weight_decay=0.1),
                    },
                    lambda p: labels,
                ),
                every_k=2,
            ),
            max_consecutive_errors=2,
        ),
    )
    eager_p, eager_s = _run(tx, params, grads_seq)
    comp_p, comp_s = _run(tx, params, grads_seq, {"backend": "eager"})
    assert_trees_close(comp_p, eager_p, rtol=1e-6, atol=1e-7)
    assert_trees_close(comp_s, eager_s, rtol=1e-6, atol=1e-7)
    for k in shapes:
        assert not torch.allclose(comp_p[k], params[k])  # every group moved

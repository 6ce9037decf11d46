"""Bench: the Kronecker-factored Laplace approximation against laplace-torch, CPU, float32.

A 64-128-10 tanh MLP on the 1797 8x8 digits, briefly trained (the MAP). laplace-torch
0.3's ``Laplace(net, "classification", hessian_structure="kron")`` with its curvlinops
backend (exact GGN, K-FAC expand, weight and bias in separate blocks) against
``transforms.laplace(model, params, x, structure="kron", separate_bias=True)``, which
builds the same matrix: each case checks that the two log evidences agree.

- ``fit``: the K-FAC factors over the data (batches of 256) and their eigendecompositions.
- ``predict``: the linearised (GLM) predictive with the probit link at 256 inputs.
- ``last_layer``: laplace-torch's defaults, ``Laplace(net, "classification")`` (the
  last layer, K-FAC), against ``laplace(..., structure="kron", subset=[the last
  layer's weight and bias])``, fit and the probit predictive at 256 inputs.
- ``factors``: the K-FAC factors alone, curvlinops 3.0.1's ``KFACLinearOperator``
  (``fisher_type="type-2"``, ``kfac_approx="expand"``, weight and bias in one block)
  against ``transforms.kfac``; the case checks the factors agree.

laplace-torch pins a newer torch than the one this project tests on, so it is not a
dev dependency. Install it beside the environment without its dependencies
(``pip install --no-deps --target /tmp/lapsite laplace-torch==0.3
curvlinops-for-pytorch==3.0.1 backpack-for-pytorch==1.7.1 asdfghjkl==0.1a4 unfoldNd==0.2.3
einconv==0.1.0 linear_operator==0.6.1``) and run
``PYTHONPATH=/tmp/lapsite pytest bench/test_bench_laplace.py --benchmark-only``.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchfn
from torchfn import optim, random
from torchfn.data import load_digits
from torchfn.transforms import kfac, laplace, laplace_log_marginal, laplace_predict

laplace_torch = pytest.importorskip(
    "laplace", reason="laplace-torch is the peer; see the module docstring to install it")

X, Y = load_digits()
NET = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 10))
MODEL = torchfn.Model(NET)
DELTA, BATCH = 1.0, 256


def _train():
    params = MODEL.init(random.key(0))
    tx = optim.adam(1e-2)
    state = tx.init(params)

    def loss(p):
        return F.cross_entropy(MODEL(p, X), Y)

    for _ in range(100):
        g = torch.func.grad(loss)(params)
        updates, state = tx.update(g, state, params)
        params = optim.apply_updates(params, updates)
    return params


PARAMS = _train()
NET.load_state_dict(PARAMS)
LOG_LIK = -F.cross_entropy(MODEL(PARAMS, X), Y, reduction="sum").detach()


def _peer():
    from laplace.curvature import CurvlinopsGGN

    la = laplace_torch.Laplace(NET, "classification", subset_of_weights="all",
                               hessian_structure="kron", prior_precision=DELTA,
                               backend=CurvlinopsGGN)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y),
                                         batch_size=BATCH)
    la.fit(loader, progress_bar=False)
    return la


def _ours():
    return laplace(MODEL, PARAMS, X, structure="kron", prior_precision=DELTA,
                   separate_bias=True, batch_size=BATCH)


def _check(la, post):
    ours = laplace_log_marginal(post, LOG_LIK)
    torch.testing.assert_close(ours, la.log_marginal_likelihood().detach(), rtol=1e-5,
                               atol=1e-2)


@pytest.mark.parametrize("how", ["laplace_torch", "torchfn"])
def test_fit(benchmark, how):
    result = benchmark.pedantic(_peer if how == "laplace_torch" else _ours, rounds=3)
    _check(*((result, _ours()) if how == "laplace_torch" else (_peer(), result)))


@pytest.mark.parametrize("how", ["laplace_torch", "torchfn"])
def test_predict(benchmark, how):
    la, post = _peer(), _ours()
    x_new = X[:256]
    if how == "laplace_torch":
        probs = benchmark.pedantic(lambda: la(x_new, pred_type="glm", link_approx="probit"),
                                   rounds=3)
    else:
        probs = benchmark.pedantic(lambda: laplace_predict(post, MODEL, x_new)[0], rounds=3)
    other = (laplace_predict(post, MODEL, x_new)[0] if how == "laplace_torch" else
             la(x_new, pred_type="glm", link_approx="probit"))
    torch.testing.assert_close(probs.detach(), other.detach(), rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("how", ["curvlinops", "torchfn"])
def test_factors(benchmark, how):
    from curvlinops import KFACLinearOperator

    def peer():
        op = KFACLinearOperator(NET, nn.CrossEntropyLoss(reduction="sum"),
                                list(NET.parameters()), [(X, Y)], fisher_type="type-2",
                                kfac_approx="expand", separate_weight_and_bias=False,
                                check_deterministic=False)
        op.compute_kronecker_factors()
        return {n: (op._input_covariances[n], op._gradient_covariances[n]) for n in ("0", "2")}

    def ours():
        return {n: (f.A, f.G) for n, f in kfac(MODEL, PARAMS, X).items()}

    got = benchmark.pedantic(peer if how == "curvlinops" else ours, rounds=3)
    other = ours() if how == "curvlinops" else peer()
    for n in ("0", "2"):
        for a, b in zip(got[n], other[n]):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-4, atol=1e-6)


def _peer_last_layer():
    la = laplace_torch.Laplace(NET, "classification", prior_precision=DELTA)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y),
                                         batch_size=BATCH)
    la.fit(loader, progress_bar=False)
    return la, la(X[:256], pred_type="glm", link_approx="probit")


def _ours_last_layer():
    post = laplace(MODEL, PARAMS, X, structure="kron", prior_precision=DELTA,
                   separate_bias=True, batch_size=BATCH, subset=["2.weight", "2.bias"])
    return post, laplace_predict(post, MODEL, X[:256])[0]


@pytest.mark.parametrize("how", ["laplace_torch", "torchfn"])
def test_last_layer(benchmark, how):
    got = benchmark.pedantic(_peer_last_layer if how == "laplace_torch" else
                             _ours_last_layer, rounds=3)
    (la, probs_peer), (post, probs) = ((got, _ours_last_layer()) if how == "laplace_torch"
                                       else (_peer_last_layer(), got))
    _check(la, post)
    torch.testing.assert_close(probs.detach(), probs_peer.detach(), rtol=1e-3, atol=1e-4)

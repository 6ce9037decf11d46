"""Bench: EK-FAC influence scores against kronfluence 1.0.1, CPU, float32.

A 64-128-10 tanh MLP on the 1797 8x8 digits, briefly trained. Both sides fit EK-FAC
with the empirical Fisher (kronfluence's ``use_empirical_fisher=True``; its default
samples targets from the model, which two libraries cannot draw alike) over all 1797
digits in batches of 256, then score 32 query digits against all 1797 with damping
1e-3. Each case checks that the two score matrices agree.

- ``fit``: ``transforms.ekfac`` vs ``Analyzer.fit_all_factors`` (covariances,
  eigendecomposition, eigenvalue correction).
- ``scores``: ``transforms.influence`` vs ``Analyzer.compute_pairwise_scores``, the
  factors fitted beforehand.

kronfluence pins a newer torch than the one this project tests on, so it is not a dev
dependency. Install it beside the environment without its dependencies
(``pip install --no-deps --target /tmp/kfsite kronfluence==1.0.1 accelerate==1.16.0
opt_einsum einconv==0.1.0``) and run ``PYTHONPATH=/tmp/kfsite pytest bench/test_bench_influence.py
--benchmark-only``. kronfluence writes its factors and scores under a temporary folder.
"""

import copy
import tempfile

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchfn
from torchfn import optim, random
from torchfn.data import load_digits
from torchfn.transforms import ekfac, influence

kronfluence = pytest.importorskip(
    "kronfluence", reason="kronfluence is the peer; see the module docstring to install it")

X, Y = load_digits()
QUERY = slice(0, 32)
NET = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 10))
MODEL = torchfn.Model(NET)
BATCH, DAMPING = 256, 1e-3


def _train():
    params = MODEL.init(random.key(0))
    tx = optim.adam(1e-2)
    state = tx.init(params)
    for _ in range(100):
        g = torch.func.grad(lambda p: F.cross_entropy(MODEL(p, X), Y))(params)
        updates, state = tx.update(g, state, params)
        params = optim.apply_updates(params, updates)
    return params


PARAMS = _train()
NET.load_state_dict(PARAMS)
NET.eval()


def _loss(out, y):
    return F.cross_entropy(out, y, reduction="none")


def _ours_fit():
    return ekfac(MODEL, PARAMS, X, fisher="empirical", y=Y, batch_size=BATCH)


def _ours_scores(factors):
    return influence(MODEL, PARAMS, factors, (X, Y), (X[QUERY], Y[QUERY]), _loss,
                     damping=DAMPING, batch_size=BATCH)


class _Digits(kronfluence.Task):
    def compute_train_loss(self, batch, model, sample=False):
        x, y = batch
        return F.cross_entropy(model(x), y, reduction="sum")

    def compute_measurement(self, batch, model):
        return self.compute_train_loss(batch, model)


def _peer():
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments, ScoreArguments

    folder = tempfile.mkdtemp()
    net = prepare_model(copy.deepcopy(NET), _Digits())  # it wraps the modules in place
    analyzer = Analyzer("digits", net, _Digits(), cpu=True, disable_tqdm=True,
                        output_dir=folder, log_level=40)
    data = torch.utils.data.TensorDataset(X, Y)
    factor_args = FactorArguments(strategy="ekfac", use_empirical_fisher=True)
    score_args = ScoreArguments(damping_factor=DAMPING)

    def fit():
        analyzer.fit_all_factors("ekfac", data, per_device_batch_size=BATCH,
                                 factor_args=factor_args, overwrite_output_dir=True)

    def scores():
        analyzer.compute_pairwise_scores(
            "scores", "ekfac", torch.utils.data.TensorDataset(X[QUERY], Y[QUERY]), data,
            per_device_query_batch_size=32, per_device_train_batch_size=BATCH,
            score_args=score_args, overwrite_output_dir=True)
        return analyzer.load_pairwise_scores("scores")["all_modules"]

    return fit, scores


def _check(ours, peer):
    scale = peer.abs().max()
    torch.testing.assert_close(ours / scale, peer / scale, rtol=0, atol=2e-3)


@pytest.mark.parametrize("how", ["kronfluence", "torchfn"])
def test_fit(benchmark, how):
    if how == "kronfluence":
        fit, scores = _peer()
        benchmark.pedantic(fit, rounds=3)
        _check(_ours_scores(_ours_fit()), scores())
    else:
        factors = benchmark.pedantic(_ours_fit, rounds=3)
        fit, scores = _peer()
        fit()
        _check(_ours_scores(factors), scores())


@pytest.mark.parametrize("how", ["kronfluence", "torchfn"])
def test_scores(benchmark, how):
    if how == "kronfluence":
        fit, scores = _peer()
        fit()
        got = benchmark.pedantic(scores, rounds=3)
        _check(_ours_scores(_ours_fit()), got)
    else:
        factors = _ours_fit()
        got = benchmark.pedantic(lambda: _ours_scores(factors), rounds=3)
        fit, scores = _peer()
        fit()
        _check(got, scores())

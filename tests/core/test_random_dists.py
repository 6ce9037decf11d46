"""The distributions of torchfn.random beyond uniform / normal: JAX's values for the
same keys (data/jax_golden_dists.json, from make_jax_golden.py), the right law (KS
tests against scipy), vmap over keys == a loop (gamma's fixed-round path included),
compile, and bad input."""

from __future__ import annotations

import json
import pathlib

import pytest
import scipy.stats
import torch
from hypothesis import given
from hypothesis import strategies as st

from torchfn import random

GOLDEN = json.loads(
    (pathlib.Path(__file__).parent / "data" / "jax_golden_dists.json").read_text())
CASES = GOLDEN["cases"]
IDS = [f"seed={c['seed']}{'-x64' if c['x64'] else ''}" for c in CASES]
ALPHA = 1e-6  # KS false-alarm level
ALPHAS = [0.3, 1.0, 2.5, 10.0, 0.05, 1e-3, 0.999, 40.0] * 25
LAMS = [0.0, 0.5, 3.0, 9.99, 10.0, 25.0, 150.0, 1e4] * 25
BIN_N = [0.0, 5.0, 20.0, 30.0, 200.0, 5000.0] * 30
BIN_P = [0.3] * 60 + [0.9] * 60 + [0.02] * 60
# draw their random signs by rademacher's bernoulli(0.5), which JAX's x64 mode draws in
# float64 (see ``ours``)
X64_SIGNS = {"rademacher", "double_sided_maxwell", "generalized_normal", "ball"}


def decode(entry: dict) -> torch.Tensor:
    if "values" in entry:
        return torch.tensor(entry["values"]).reshape(entry["shape"])
    dtype, it, nb = {"float32": (torch.float32, torch.int32, 32),
                     "float64": (torch.float64, torch.int64, 64)}[entry["dtype"]]
    vals = [v - (1 << nb) if v >= 1 << (nb - 1) else v for v in entry["bits"]]
    return torch.tensor(vals, dtype=torch.int64).to(it).view(dtype).reshape(entry["shape"])


def ours(k: torch.Tensor, f: torch.dtype) -> dict[str, torch.Tensor]:
    """The same calls as make_jax_golden.py's DISTS_CHILD. JAX's x64 mode draws
    ``geometric(k, 0.3)`` and ``rademacher``'s ``bernoulli(k, 0.5)`` from float64
    uniforms: here a float64 ``p`` does that for geometric; rademacher has no such
    argument (it draws as JAX's default mode), so it and the samplers that draw signs
    with it are left out of the x64 cases."""
    out = {
        "exponential": random.exponential(k, (200,), f),
        "laplace": random.laplace(k, (200,), f),
        "logistic": random.logistic(k, (200,), f),
        "cauchy": random.cauchy(k, (200,), f),
        "rademacher": random.rademacher(k, (200,)),
        "lognormal": random.lognormal(k, 0.7, (200,), f),
        "pareto": random.pareto(k, 2.5, (200,), f),
        "weibull_min": random.weibull_min(k, 2.0, 1.5, (200,), f),
        "rayleigh": random.rayleigh(k, 1.5, (200,), f),
        "maxwell": random.maxwell(k, (200,), f),
        "geometric": random.geometric(k, torch.tensor(0.3, dtype=f), (200,)).long(),
        "triangular": random.triangular(k, -1.0, 0.5, 2.0, (200,), f),
        "gamma": random.gamma(k, torch.tensor(ALPHAS, dtype=f), dtype=f),
        "loggamma": random.loggamma(k, torch.tensor(ALPHAS, dtype=f), dtype=f),
        "beta": random.beta(k, 0.4, 2.0, (200,), f),
        "dirichlet": random.dirichlet(k, torch.tensor([0.5, 1.0, 3.0], dtype=f), (50,), f),
        "chisquare": random.chisquare(k, 3.0, (200,), f),
        "t": random.t(k, 4.0, (200,), f),
    }
    cov = torch.tensor([[2.0, 0.6, 0.1], [0.6, 1.0, -0.3], [0.1, -0.3, 0.5]], dtype=f)
    mean = torch.tensor([1.0, -2.0, 0.5], dtype=f)
    out["mvn_cholesky"] = random.multivariate_normal(k, mean, cov, (40,), f, "cholesky")
    idt = torch.int64 if f == torch.float64 else torch.int32
    out["poisson"] = random.poisson(k, torch.tensor(LAMS, dtype=f), dtype=idt)
    out["poisson_scalar"] = random.poisson(k, torch.tensor(4.0, dtype=f), (200,), dtype=idt)
    out["binomial"] = random.binomial(k, torch.tensor(BIN_N, dtype=f),
                                      torch.tensor(BIN_P, dtype=f), dtype=f)
    out["multinomial"] = random.multinomial(
        k, torch.tensor([7.0, 60.0], dtype=f), torch.tensor([0.1, 0.25, 0.4, 0.25], dtype=f),
        (2, 4), f)
    out["wald"] = random.wald(k, 1.7, (200,), f)
    out["double_sided_maxwell"] = random.double_sided_maxwell(k, 0.5, 2.0, (200,), f)
    out["f"] = random.f(k, 5.0, 7.0, (200,), f)
    out["generalized_normal"] = random.generalized_normal(k, 1.5, (200,), f)
    out["ball"] = random.ball(k, 3, 1.5, (40,), f)
    out["orthogonal"] = random.orthogonal(k, 5, (3,), f)
    out["orthogonal_wide"] = random.orthogonal(k, 3, (), f, m=6)
    if f == torch.float64:
        for name in X64_SIGNS:
            del out[name]
    return out


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_golden_jax_values(case):
    """Integers exactly; floats to a few float32 ulp (torch's log/log1p/tan/pow are not
    XLA's), the gamma family's rejection loops included: one accept/reject decision
    taken differently would move a sample by far more than that."""
    f = torch.float64 if case["x64"] else torch.float32
    tol = dict(rtol=1e-12, atol=1e-12) if case["x64"] else dict(rtol=4e-6, atol=2e-6)
    got = ours(random.key(case["seed"]), f)
    assert set(got) == set(case) - {"seed", "x64"} - (X64_SIGNS if case["x64"] else set())
    for name, value in got.items():
        ref = decode(case[name])
        assert value.shape == ref.shape, name
        if name == "binomial":  # JAX's counts where n min(p, 1 - p) <= 10 (its docstring)
            n, p = torch.tensor(BIN_N), torch.tensor(BIN_P)
            inversion = n * torch.minimum(p, 1 - p) <= 10
            assert value[inversion].tolist() == ref[inversion].tolist(), name
        elif value.is_floating_point():
            assert value.dtype == ref.dtype, name
            # wald's x = mu + mu^2 y / 2 - (mu / 2) sqrt(...) cancels: a few ulp of the
            # normal it is made from become ~1e-5 relative
            loose = dict(tol, rtol=2e-5) if name == "wald" and not case["x64"] else tol
            torch.testing.assert_close(value, ref, msg=name, **loose)
        elif name == "poisson":  # JAX's values where lam < 10 (see poisson's docstring)
            knuth = torch.tensor(LAMS) < 10
            assert value[knuth].tolist() == ref[knuth].tolist(), name
        else:
            assert value.tolist() == ref.tolist(), name


class _DoubleSidedMaxwell:
    """|X - loc| / scale is Maxwell, the sign is fair."""

    def __init__(self, loc, scale):
        self.loc, self.scale = loc, scale

    def cdf(self, x):
        import numpy as np

        z = (np.asarray(x) - self.loc) / self.scale
        return 0.5 + 0.5 * np.sign(z) * scipy.stats.maxwell.cdf(np.abs(z))


@pytest.mark.parametrize("name,sample,law", [
    ("exponential", lambda k: random.exponential(k, (4000,)), scipy.stats.expon()),
    ("laplace", lambda k: random.laplace(k, (4000,)), scipy.stats.laplace()),
    ("logistic", lambda k: random.logistic(k, (4000,)), scipy.stats.logistic()),
    ("cauchy", lambda k: random.cauchy(k, (4000,)), scipy.stats.cauchy()),
    ("lognormal", lambda k: random.lognormal(k, 0.6, (4000,)), scipy.stats.lognorm(0.6)),
    ("pareto", lambda k: random.pareto(k, 2.5, (4000,)), scipy.stats.pareto(2.5)),
    ("weibull_min", lambda k: random.weibull_min(k, 2.0, 1.7, (4000,)),
     scipy.stats.weibull_min(1.7, scale=2.0)),
    ("rayleigh", lambda k: random.rayleigh(k, 1.5, (4000,)), scipy.stats.rayleigh(scale=1.5)),
    ("maxwell", lambda k: random.maxwell(k, (4000,)), scipy.stats.maxwell()),
    ("triangular", lambda k: random.triangular(k, -1.0, 0.25, 2.0, (4000,)),
     scipy.stats.triang(1.25 / 3, loc=-1.0, scale=3.0)),
    ("gamma_small", lambda k: random.gamma(k, 0.3, (4000,)), scipy.stats.gamma(0.3)),
    ("gamma_large", lambda k: random.gamma(k, 7.5, (4000,)), scipy.stats.gamma(7.5)),
    ("beta", lambda k: random.beta(k, 0.4, 2.0, (4000,)), scipy.stats.beta(0.4, 2.0)),
    ("chisquare", lambda k: random.chisquare(k, 3.0, (4000,)), scipy.stats.chi2(3.0)),
    ("t", lambda k: random.t(k, 4.0, (4000,)), scipy.stats.t(4.0)),
    ("f", lambda k: random.f(k, 5.0, 7.0, (4000,)), scipy.stats.f(5.0, 7.0)),
    ("wald", lambda k: random.wald(k, 1.7, (4000,)), scipy.stats.invgauss(1.7)),
    ("double_sided_maxwell", lambda k: random.double_sided_maxwell(k, 0.5, 2.0, (4000,)),
     _DoubleSidedMaxwell(0.5, 2.0)),
    ("generalized_normal", lambda k: random.generalized_normal(k, 1.5, (4000,)),
     scipy.stats.gennorm(1.5)),
    ("dirichlet_marginal",
     lambda k: random.dirichlet(k, torch.tensor([0.5, 1.0, 3.0]), (4000,))[:, 2],
     scipy.stats.beta(3.0, 1.5)),
])
@given(seed=st.integers(0, 2**31 - 1))
def test_law_matches_scipy(name, sample, law, seed):
    x = sample(random.key(seed)).double().numpy()
    assert scipy.stats.kstest(x, law.cdf).pvalue > ALPHA, f"{name} seed={seed}"


@given(seed=st.integers(0, 2**31 - 1), p=st.floats(0.05, 0.95))
def test_geometric_and_rademacher_frequencies(seed, p):
    k1, k2 = random.split(random.key(seed))
    n = random.geometric(k1, p, (4000,)).double()
    # P(N = j) = (1 - p)^(j-1) p: chi-square over j = 1, 2, ... and a tail bin, with
    # at least 5 expected in every bin (the test's validity condition)
    probs, j = [], 1
    while (1 - p) ** j * 4000 >= 5:  # the tail beyond j still expects >= 5
        probs.append((1 - p) ** (j - 1) * p)
        j += 1
    counts = [int((n == i + 1).sum()) for i in range(len(probs))] + [int((n > len(probs)).sum())]
    probs.append((1 - p) ** len(probs))
    assert scipy.stats.chisquare(counts, [4000 * q for q in probs]).pvalue > ALPHA
    r = random.rademacher(k2, (4000,))
    assert set(r.unique().tolist()) <= {-1, 1}
    assert scipy.stats.binomtest(int((r == 1).sum()), 4000, 0.5).pvalue > ALPHA


def _discrete_chisquare_pvalue(x, law) -> float:
    """Chi-square p-value of integer samples ``x`` against a scipy discrete ``law``:
    one bin per value in the law's central 99.8%, two tail bins, and neighbouring
    bins merged until each expects at least 5 (the test's validity condition)."""
    n = len(x)
    lo, hi = int(law.ppf(1e-3)), int(law.ppf(1 - 1e-3))
    counts = [int((x < lo).sum())] + [int((x == j).sum()) for j in range(lo, hi)] + [
        int((x >= hi).sum())]
    expected = [law.cdf(lo - 1)] + [law.pmf(j) for j in range(lo, hi)] + [law.sf(hi - 1)]
    merged_c, merged_e, c_acc, e_acc = [], [], 0, 0.0
    for c, e in zip(counts, expected):
        c_acc, e_acc = c_acc + c, e_acc + e * n
        if e_acc >= 5:
            merged_c.append(c_acc)
            merged_e.append(e_acc)
            c_acc, e_acc = 0, 0.0
    merged_c[-1] += c_acc
    merged_e[-1] += e_acc
    scale = sum(merged_c) / sum(merged_e)
    return scipy.stats.chisquare(merged_c, [e * scale for e in merged_e]).pvalue


@pytest.mark.parametrize("lam", [0.7, 6.0, 12.0, 80.0, 3000.0])
@given(seed=st.integers(0, 2**31 - 1))
def test_poisson_law(lam, seed):
    """Chi-square over bins of at least 5 expected counts: Knuth (lam < 10) and the
    transformed rejection (lam >= 10) both give Poisson(lam)."""
    n = random.poisson(random.key(seed), lam, (4000,)).numpy()
    assert _discrete_chisquare_pvalue(n, scipy.stats.poisson(lam)) > ALPHA


@given(seed=st.integers(0, 2**31 - 1), p=st.sampled_from([1.0, 1.5, 2.0, 4.0]))
def test_ball_is_uniform_in_the_p_ball(seed, p):
    """The p-norm of a uniform point in the d-ball has CDF r^d."""
    d = 3
    x = random.ball(random.key(seed), d, p, (4000,), torch.float64)
    r = (x.abs() ** p).sum(-1) ** (1 / p)
    assert bool((r <= 1).all())
    assert scipy.stats.kstest(r.numpy(), lambda v: v**d).pvalue > ALPHA


@pytest.mark.parametrize("n,p", [(12.0, 0.3), (40.0, 0.85), (500.0, 0.4), (3000.0, 0.97)])
@given(seed=st.integers(0, 2**31 - 1))
def test_binomial_law(n, p, seed):
    """Chi-square over bins of at least 5 expected counts, for both samplers (n q <= 10
    is inversion, above is BTRS) and both sides of p = 1/2."""
    x = random.binomial(random.key(seed), n, p, (4000,), torch.float64).numpy()
    assert _discrete_chisquare_pvalue(x, scipy.stats.binom(int(n), p)) > ALPHA


@given(seed=st.integers(0, 2**31 - 1))
def test_multinomial_counts_sum_to_n_and_have_the_right_means(seed):
    p = torch.tensor([0.1, 0.25, 0.4, 0.25], dtype=torch.float64)
    c = random.multinomial(random.key(seed), torch.full((4000,), 30.0), p, (4000, 4),
                           torch.float64)
    assert bool((c.sum(-1) == 30).all()) and bool((c >= 0).all())
    # each category's count is Binomial(30, p_i): its mean within 6 standard errors
    se = (30 * p * (1 - p) / 4000).sqrt()
    assert bool(((c.mean(0) - 30 * p).abs() < 6 * se).all())


def test_gamma_loop_under_vmap_equals_the_eager_loop():
    """Under vmap the gamma family runs fixed, masked rounds; eagerly it loops until
    every element accepts. Both must give each key's own samples."""
    keys = random.split(random.key(3), 5)
    a = torch.tensor([0.3, 1.0, 2.5, 10.0, 0.05, 1e-3] * 10)
    for fn in (lambda k: random.gamma(k, a), lambda k: random.loggamma(k, a),
               lambda k: random.beta(k, 0.4, 0.4, (40,)),
               lambda k: random.dirichlet(k, torch.tensor([0.2, 1.0, 5.0]), (7,)),
               lambda k: random.t(k, 3.0, (30,)),
               lambda k: random.poisson(k, torch.tensor([0.0, 2.0, 9.5, 30.0] * 5)),
               lambda k: random.binomial(k, torch.tensor([3.0, 50.0, 400.0] * 5), 0.3)):
        batched = torch.func.vmap(fn)(keys)
        looped = torch.stack([fn(k) for k in keys])
        assert torch.equal(batched, looped)


def test_vmap_compile_and_pathwise_gradients_of_the_transforms():
    keys = random.split(random.key(4), 3)
    for fn in (lambda k: random.exponential(k, (20,)), lambda k: random.cauchy(k, (20,)),
               lambda k: random.maxwell(k, (20,)), lambda k: random.geometric(k, 0.2, (20,)),
               lambda k: random.triangular(k, 0.0, 0.3, 1.0, (20,))):
        assert torch.equal(torch.func.vmap(fn)(keys), torch.stack([fn(k) for k in keys]))
        compiled = torch.compile(fn, fullgraph=True, backend="eager")
        torch.testing.assert_close(compiled(keys[0]), fn(keys[0]), rtol=0, atol=0)
    # lognormal is exp(sigma z): d/dsigma = z exp(sigma z)
    k = random.key(5)
    g = torch.func.grad(lambda s: random.lognormal(k, s, (10,)).sum())(torch.tensor(0.5))
    z = random.normal(k, (10,))
    torch.testing.assert_close(g, (z * torch.exp(0.5 * z)).sum())
    # the gamma family is a graph break under compile and still gives the eager values
    compiled = torch.compile(lambda k: random.beta(k, 2.0, 3.0, (25,)), backend="eager")
    assert torch.equal(compiled(k), random.beta(k, 2.0, 3.0, (25,)))


@pytest.mark.parametrize("method", ["cholesky", "eigh", "svd"])
@given(seed=st.integers(0, 2**31 - 1))
def test_multivariate_normal_has_the_mean_and_covariance(method, seed):
    """Every factorisation gives N(mean, cov): the whitened samples are standard normal
    (KS per coordinate) and uncorrelated. eigh and svd need only semi-definiteness."""
    cov = torch.tensor([[2.0, 0.6, 0.1], [0.6, 1.0, -0.3], [0.1, -0.3, 0.5]], dtype=torch.float64)
    mean = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    x = random.multivariate_normal(random.key(seed), mean, cov, (4000,), method=method)
    white = torch.linalg.solve_triangular(torch.linalg.cholesky(cov), (x - mean).T, upper=False)
    for row in white:
        assert scipy.stats.kstest(row.numpy(), "norm").pvalue > ALPHA
    corr = torch.corrcoef(white)
    assert float((corr - torch.eye(3, dtype=corr.dtype)).abs().max()) < 0.1
    singular = torch.tensor([[1.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
    if method != "cholesky":
        y = random.multivariate_normal(random.key(seed), torch.zeros(2, dtype=torch.float64),
                                       singular, (100,), method=method)
        torch.testing.assert_close(y[:, 0], y[:, 1], rtol=0, atol=1e-6)  # on the line x0 = x1


@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 7), m=st.integers(1, 7))
def test_orthogonal_is_orthonormal_and_haar(seed, n, m):
    q = random.orthogonal(random.key(seed), n, (200,), torch.float64, m=m)
    assert q.shape == (200, n, m)
    gram = q.mT @ q if n >= m else q @ q.mT
    torch.testing.assert_close(gram, torch.eye(min(n, m), dtype=q.dtype).expand_as(gram))
    if n >= 3 and m == n:  # Haar: an entry times sqrt(n) is about N(0, 1) for large n;
        # exactly, q[0, 0] has the law of a coordinate of a uniform point on the sphere
        x = q[:, 0, 0].numpy()
        law = scipy.stats.beta((n - 1) / 2, (n - 1) / 2, loc=-1, scale=2)
        assert scipy.stats.kstest(x, law.cdf).pvalue > ALPHA


def test_parameter_tensors_broadcast_to_the_shape():
    k = random.key(6)
    a = torch.tensor([[0.5], [5.0]])  # (2, 1)
    g = random.gamma(k, a, (2, 1000))
    assert g.shape == (2, 1000) and float(g[0].mean()) < 1.0 < 4.0 < float(g[1].mean())
    b = torch.tensor([1.0, 4.0])
    assert random.pareto(k, b).shape == (2,)
    assert random.beta(k, torch.ones(3), 2.0).shape == (3,)
    assert random.dirichlet(k, torch.ones(4, 3)).shape == (4, 3)


@pytest.mark.parametrize("call,exc,match", [
    (lambda k: random.gamma(k, 0.0), ValueError, "gamma: the shape parameter must be > 0"),
    (lambda k: random.gamma(k, torch.tensor([1.0, -1.0])), ValueError, "must be > 0"),
    (lambda k: random.gamma(k, torch.ones(3), (2,)), ValueError,
     r"a of shape \(3,\) does not broadcast to shape \(2,\)"),
    (lambda k: random.geometric(k, 0.0), ValueError, r"geometric: p must be in \(0, 1\], got 0"),
    (lambda k: random.pareto(k, -1.0), ValueError, "pareto: b must be > 0, got -1"),
    (lambda k: random.rayleigh(k, 0.0), ValueError, "rayleigh: scale must be > 0"),
    (lambda k: random.dirichlet(k, torch.tensor(1.0)), ValueError,
     "dirichlet: alpha must be a tensor with at least 1 dim"),
    (lambda k: random.exponential(k, (3,), torch.int32), TypeError,
     "exponential: dtype must be one of float32"),
    (lambda k: random.rademacher(k, (3,), torch.bool), TypeError,
     "rademacher: dtype must be a signed integer or float dtype"),
    (lambda k: random.lognormal(k, "1"), TypeError, "lognormal: sigma must be a float"),
    (lambda k: random.t(torch.zeros(3, dtype=torch.int32), 2.0), ValueError,
     r"t: key must have shape \(2,\)"),
    (lambda k: random.multivariate_normal(k, torch.zeros(3), torch.eye(2)), ValueError,
     r"cov must have shape \(..., 3, 3\) for mean of shape \(3,\), got \(2, 2\)"),
    (lambda k: random.multivariate_normal(k, torch.zeros(2), torch.eye(2), method="qr"),
     ValueError, "method must be one of"),
    (lambda k: random.orthogonal(k, 0), ValueError, "orthogonal: n must be an int >= 1, got 0"),
    (lambda k: random.poisson(k, -1.0), ValueError, "poisson: lam must be >= 0, got -1"),
    (lambda k: random.binomial(k, -2.0, 0.5), ValueError, "binomial: n must be >= 0, got -2"),
    (lambda k: random.multinomial(k, 5.0, torch.tensor(0.5)), ValueError,
     "multinomial: p must be a tensor"),
    (lambda k: random.binomial(k, 5.0, torch.tensor([0.2, 1.5])), ValueError,
     r"binomial: p must be in \[0, 1\]"),
])
def test_bad_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call(random.key(0))


def test_gamma_gradients_are_the_implicit_reparameterisation():
    """d sample / d a at fixed CDF value, as JAX and torch's Gamma.rsample: equal to
    torch's _standard_gamma_grad, by autograd, torch.func.grad, vmap(grad) and jvp."""
    k = random.key(7)
    a = torch.tensor([0.3, 1.0, 2.5, 10.0])
    g = random.gamma(k, a)
    expected = torch._standard_gamma_grad(a, g)
    leaf = a.clone().requires_grad_(True)
    random.gamma(k, leaf).sum().backward()
    torch.testing.assert_close(leaf.grad, expected)
    torch.testing.assert_close(torch.func.grad(lambda x: random.gamma(k, x).sum())(a), expected)
    _, tangent = torch.func.jvp(lambda x: random.gamma(k, x), (a,), (torch.ones(4),))
    torch.testing.assert_close(tangent, expected)
    batch = torch.stack([a, a * 2])
    per_row = torch.func.vmap(torch.func.grad(lambda x: random.gamma(k, x).sum()))(batch)
    for i in range(2):
        row = torch._standard_gamma_grad(batch[i], random.gamma(k, batch[i]))
        torch.testing.assert_close(per_row[i], row)
    assert not random.gamma(k, a).requires_grad  # nothing attached without a gradient


@pytest.mark.parametrize("a", [0.5, 3.0])
def test_gradients_of_expectations_match_closed_forms(a):
    """Pathwise estimates over 20k samples: d E[G]/da = 1, d E[log G]/da = trigamma(a),
    d E[Beta(a, 2)]/da = 2 / (a + 2)^2."""
    import scipy.special

    k1, k2, k3 = random.split(random.key(8), 3)
    x = torch.tensor(a, dtype=torch.float64)
    d_mean = torch.func.grad(lambda s: random.gamma(k1, s, (20_000,), torch.float64).mean())(x)
    assert abs(float(d_mean) - 1.0) < 0.05
    d_log = torch.func.grad(
        lambda s: random.loggamma(k2, s, (20_000,), torch.float64).mean())(x)
    assert abs(float(d_log) / scipy.special.polygamma(1, a) - 1) < 0.05
    d_beta = torch.func.grad(
        lambda s: random.beta(k3, s, 2.0, (20_000,), torch.float64).mean())(x)
    assert abs(float(d_beta) / (2 / (a + 2) ** 2) - 1) < 0.05


@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 300))
def test_in_place_keyed_hash_equals_the_out_of_place_hash(seed, n):
    from torchfn.core import _threefry

    g = torch.Generator().manual_seed(seed)
    k0, k1, x0, x1 = (torch.randint(-(2**31), 2**31 - 1, (n,), generator=g, dtype=torch.int32)
                      for _ in range(4))
    expected = _threefry.threefry2x32(k0, k1, x0, x1)
    got = _threefry.threefry2x32_keyed_(k0, k1, x0.clone(), x1.clone())
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])

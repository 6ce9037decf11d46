"""Generate tests/core/data/jax_golden.json (keys, bits, uniform, normal, the discrete
samplers) and jax_golden_dists.json (the distributions built on them) from JAX (run by
hand, not by the tests).

    python3 -m venv /tmp/jaxvenv && /tmp/jaxvenv/bin/pip install jax jaxlib
    /tmp/jaxvenv/bin/python tests/core/data/make_jax_golden.py

JAX is not a dependency of torchfn: these vectors are the external reference
that torchfn.random must reproduce bit for bit (normal to float32 rounding).
Each case runs in a fresh subprocess so the default (32-bit) and the
``jax_enable_x64`` modes do not mix. Keys are stored as uint32 words, bits as
unsigned ints, floats as their bit patterns.
"""

import json
import os
import subprocess
import sys

SEEDS = [0, 1, 42, 123456789, 2**31 - 1, -1, -7]
SEEDS_X64 = [2**32 + 7, 2**40 + 3, 2**63 - 1, -(2**40)]
SHAPES = [(), (5,), (3, 4), (1000,)]

CHILD = r"""
import json, sys
import numpy as np
x64 = sys.argv[1] == "1"
import jax
jax.config.update("jax_enable_x64", x64)
assert jax.config.jax_threefry_partitionable
import jax.numpy as jnp
from jax import random as jr

def kd(k):
    return np.asarray(jr.key_data(k)).astype(np.uint64).tolist()

def fl(a):
    a = np.asarray(a)
    ui = {2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
    if a.dtype.name == "bfloat16":
        ui = np.uint16
    return {"shape": list(a.shape), "dtype": a.dtype.name,
            "bits": a.reshape(-1).view(ui).astype(np.uint64).tolist()}

def ints(a):
    a = np.asarray(a)
    flat = a.reshape(-1)
    vals = flat.tolist() if a.dtype == np.uint64 else flat.astype(np.int64).tolist()
    return {"shape": list(a.shape), "dtype": a.dtype.name, "values": vals}

seeds = json.loads(sys.argv[2]); shapes = [tuple(s) for s in json.loads(sys.argv[3])]
out = []
for seed in seeds:
    k = jr.key(seed)
    case = {"seed": seed, "x64": x64, "key": kd(k),
            "split2": [kd(c) for c in jr.split(k)],
            "split3": [kd(c) for c in jr.split(k, 3)],
            "split_2x2": [[kd(c) for c in row] for row in jr.split(k, (2, 2))],
            "fold_in": {str(d): kd(jr.fold_in(k, d)) for d in [0, 1, 7, 2**31 - 1, 2**32 - 1]},
            "bits": {}, "uniform": {}, "normal": {}}
    for shape in shapes:
        s = json.dumps(list(shape))
        case["bits"][s] = ints(jr.bits(k, shape, jnp.uint32))
        case["uniform"][s] = fl(jr.uniform(k, shape, jnp.float32))
        case["normal"][s] = fl(jr.normal(k, shape, jnp.float32))
    case["bits8"] = ints(jr.bits(k, (16,), jnp.uint8))
    case["bits16"] = ints(jr.bits(k, (16,), jnp.uint16))
    case["uniform_range"] = fl(jr.uniform(k, (50,), jnp.float32, minval=-3.0, maxval=5.5))
    case["uniform_f16"] = fl(jr.uniform(k, (50,), jnp.float16))
    case["uniform_bf16"] = fl(jr.uniform(k, (50,), jnp.bfloat16))
    case["normal_f16"] = fl(jr.normal(k, (50,), jnp.float16))
    case["normal_bf16"] = fl(jr.normal(k, (50,), jnp.bfloat16))
    case["gumbel"] = fl(jr.gumbel(k, (50,), jnp.float32))
    case["bernoulli"] = ints(jr.bernoulli(k, 0.3, (50,)))
    case["truncated_normal"] = fl(jr.truncated_normal(k, -1.5, 2.0, (50,), jnp.float32))
    logits = jnp.log(jnp.array([0.1, 0.2, 0.3, 0.4]))
    case["categorical"] = ints(jr.categorical(k, logits, shape=(50,)))
    case["categorical_2d"] = ints(jr.categorical(k, jnp.arange(12.0).reshape(3, 4) / 4, axis=0))
    case["permutation10"] = ints(jr.permutation(k, 10))
    case["permutation2000"] = ints(jr.permutation(k, 2000))
    case["randint_int32"] = ints(jr.randint(k, (50,), -5, 17, jnp.int32))
    case["randint_int32_big"] = ints(jr.randint(k, (50,), -2**31, 2**31 - 1, jnp.int32))
    case["randint_int8"] = ints(jr.randint(k, (50,), -100, 120, jnp.int8))
    case["randint_uint8"] = ints(jr.randint(k, (50,), 0, 256, jnp.uint8))
    pw = jnp.array([0.1, 0.2, 0.3, 0.15, 0.25])
    case["choice"] = ints(jr.choice(k, 10, (7,)))
    case["choice_noreplace"] = ints(jr.choice(k, 10, (3,), replace=False))
    case["choice_p"] = ints(jr.choice(k, 5, (20,), p=pw))
    case["choice_p_noreplace"] = ints(jr.choice(k, 5, (3,), replace=False, p=pw))
    case["choice_rows"] = ints(jr.choice(k, jnp.arange(12).reshape(6, 2), (4,)))
    if x64:
        case["bits64"] = ints(jr.bits(k, (8,), jnp.uint64))
        case["uniform_f64"] = fl(jr.uniform(k, (50,), jnp.float64))
        case["normal_f64"] = fl(jr.normal(k, (50,), jnp.float64))
        case["randint_int64"] = ints(jr.randint(k, (50,), -5, 17, jnp.int64))
        case["randint_int64_big"] = ints(jr.randint(k, (50,), -2**62, 2**62 + 12345, jnp.int64))
        case["randint_int64_full"] = ints(jr.randint(k, (50,), -2**63, 2**63 - 1, jnp.int64))
    out.append(case)
print(json.dumps(out))
"""


DISTS_CHILD = r"""
import json, sys
import numpy as np
import jax
jax.config.update("jax_enable_x64", sys.argv[1] == "1")
import jax.numpy as jnp
from jax import random as jr

def enc(a):
    a = np.asarray(a)
    if a.dtype.kind == "f":
        ui = {4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
        return {"shape": list(a.shape), "dtype": a.dtype.name,
                "bits": a.reshape(-1).view(ui).astype(np.uint64).tolist()}
    return {"shape": list(a.shape), "dtype": a.dtype.name,
            "values": a.reshape(-1).astype(np.int64).tolist()}

f = jnp.float64 if sys.argv[1] == "1" else jnp.float32
alphas = jnp.array([0.3, 1.0, 2.5, 10.0, 0.05, 1e-3, 0.999, 40.0] * 25, f)
out = []
for seed in json.loads(sys.argv[2]):
    k = jr.key(seed)
    c = {"seed": seed, "x64": sys.argv[1] == "1"}
    c["exponential"] = enc(jr.exponential(k, (200,), f))
    c["laplace"] = enc(jr.laplace(k, (200,), f))
    c["logistic"] = enc(jr.logistic(k, (200,), f))
    c["cauchy"] = enc(jr.cauchy(k, (200,), f))
    c["rademacher"] = enc(jr.rademacher(k, (200,)))
    c["lognormal"] = enc(jr.lognormal(k, 0.7, (200,), f))
    c["pareto"] = enc(jr.pareto(k, 2.5, (200,), f))
    c["weibull_min"] = enc(jr.weibull_min(k, 2.0, 1.5, (200,), f))
    c["rayleigh"] = enc(jr.rayleigh(k, 1.5, (200,), f))
    c["maxwell"] = enc(jr.maxwell(k, (200,), f))
    c["geometric"] = enc(jr.geometric(k, 0.3, (200,)))
    c["triangular"] = enc(jr.triangular(k, -1.0, 0.5, 2.0, (200,), f))
    c["gamma"] = enc(jr.gamma(k, alphas, dtype=f))
    c["loggamma"] = enc(jr.loggamma(k, alphas, dtype=f))
    c["beta"] = enc(jr.beta(k, 0.4, 2.0, (200,), f))
    c["dirichlet"] = enc(jr.dirichlet(k, jnp.array([0.5, 1.0, 3.0], f), (50,), f))
    c["chisquare"] = enc(jr.chisquare(k, 3.0, (200,), f))
    c["t"] = enc(jr.t(k, 4.0, (200,), f))
    cov = jnp.array([[2.0, 0.6, 0.1], [0.6, 1.0, -0.3], [0.1, -0.3, 0.5]], f)
    mean = jnp.array([1.0, -2.0, 0.5], f)
    # eigh / svd: the factor's column signs are the backend's own, so only the law
    # (not the values) is shared with JAX; the tests check those two statistically
    c["mvn_cholesky"] = enc(jr.multivariate_normal(k, mean, cov, (40,), f, "cholesky"))
    lams = jnp.array([0.0, 0.5, 3.0, 9.99, 10.0, 25.0, 150.0, 1e4] * 25, f)
    c["poisson"] = enc(jr.poisson(k, lams))
    c["poisson_scalar"] = enc(jr.poisson(k, 4.0, (200,)))
    c["binomial"] = enc(jr.binomial(k, jnp.array([0.0, 5.0, 20.0, 30.0, 200.0, 5000.0] * 30, f),
                                    jnp.array([0.3] * 60 + [0.9] * 60 + [0.02] * 60, f)))
    c["multinomial"] = enc(jr.multinomial(k, jnp.array([7.0, 60.0], f),
                                          jnp.array([0.1, 0.25, 0.4, 0.25], f), shape=(2, 4)))
    c["wald"] = enc(jr.wald(k, 1.7, (200,), f))
    c["double_sided_maxwell"] = enc(jr.double_sided_maxwell(k, 0.5, 2.0, (200,), f))
    c["f"] = enc(jr.f(k, 5.0, 7.0, (200,), f))
    c["generalized_normal"] = enc(jr.generalized_normal(k, 1.5, (200,), f))
    c["ball"] = enc(jr.ball(k, 3, 1.5, (40,), f))
    c["orthogonal"] = enc(jr.orthogonal(k, 5, (3,), f))
    c["orthogonal_wide"] = enc(jr.orthogonal(k, 3, (), f, m=6))
    out.append(c)
print(json.dumps(out))
"""


def run_dists(x64, seeds):
    res = subprocess.run(
        [sys.executable, "-c", DISTS_CHILD, "1" if x64 else "0", json.dumps(seeds)],
        check=True, capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    return json.loads(res.stdout)


def run(x64, seeds):
    res = subprocess.run(
        [sys.executable, "-c", CHILD, "1" if x64 else "0", json.dumps(seeds), json.dumps(SHAPES)],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    return json.loads(res.stdout)


def main():
    import jax

    cases = run(False, [s for s in SEEDS]) + run(True, [0, -7] + SEEDS_X64)
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jax_golden.json")
    with open(path, "w") as f:
        json.dump(
            {
                "jax_version": jax.__version__,
                "generator": "tests/core/data/make_jax_golden.py",
                "threefry_partitionable": True,
                "cases": cases,
            },
            f,
            separators=(",", ":"),
        )
    print("wrote", path, os.path.getsize(path), "bytes")
    dists = run_dists(False, [0, 1, 42, -7]) + run_dists(True, [0, 123456789])
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jax_golden_dists.json")
    with open(path, "w") as f:
        json.dump({"jax_version": jax.__version__, "generator": "make_jax_golden.py",
                   "cases": dists}, f, separators=(",", ":"))
    print("wrote", path, os.path.getsize(path), "bytes")


if __name__ == "__main__":
    main()

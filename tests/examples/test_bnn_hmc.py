"""examples/bnn_hmc.py: HMC chains (one vmap), or NUTS chains, on a Bayesian MLP's params
classify the moons, agree with each other in function space, and are less sure far from
the data."""


def test_posterior_predicts_mixes_and_knows_where_it_has_no_data(example):
    bnn = example("bnn_hmc")
    m = bnn.main(["--chains", "4", "--samples", "80", "--warmup", "100", "--leapfrog",
                  "10"])
    assert m["accuracy"] > 0.9
    assert m["rhat_max"] < 1.1
    assert m["entropy_far"] > 1.5 * m["entropy_near"]


def test_nuts_chains_classify_and_know_where_they_have_no_data(example):
    # a short run (mixing is the HMC test's and the README run's to show)
    bnn = example("bnn_hmc")
    m = bnn.main(["--sampler", "nuts", "--chains", "2", "--samples", "30", "--warmup",
                  "40", "--max-depth", "4"])
    assert m["accuracy"] > 0.9
    assert m["entropy_far"] > 1.5 * m["entropy_near"]
    assert 1 <= m["leapfrog_per_draw"] <= 2 ** 4 - 1

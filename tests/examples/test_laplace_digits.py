"""examples/laplace_digits.py: a last-layer K-FAC Laplace posterior around an
overconfident MAP, its prior chosen on held-out digits, beats the MAP's test NLL and
calibration and is less sure on noise and shuffled digits; the evidence's prior is far
weaker and underconfident."""


def test_last_layer_laplace_is_better_calibrated_and_less_sure_off_the_data(example):
    ld = example("laplace_digits")
    m = ld.main(["--posteriors", "last_layer", "--grid", "1", "10", "100", "--steps", "300"])
    map_, val, ev = m["map"], m["last_layer/validation"], m["last_layer/evidence"]
    assert val["accuracy"] > 0.93 and abs(val["accuracy"] - map_["accuracy"]) < 0.02
    assert val["nll"] < map_["nll"] and val["ece"] < map_["ece"]
    for r in (val, ev):
        assert r["conf_noise"] < map_["conf_noise"] and r["conf_shuffled"] < map_["conf_shuffled"]
    assert ev["prior_precision"] < val["prior_precision"]
    assert ev["nll"] > map_["nll"]  # the evidence's weak prior: underconfident here

"""examples/influence_digits.py: Newton by cg on hessian_operator fits the convex model to
its optimum, and the influence-function predictions of leave-one-out changes match the
changes that refitting actually gives (Koh & Liang's check), also with EK-FAC curvature."""


def test_influence_predicts_leave_one_out_refits(example):
    influence = example("influence_digits")
    m = influence.main(["--retrain", "8"])
    assert m["fit_gradient_max"] < 1e-8  # Newton reached the optimum
    assert m["test_accuracy"] > 0.9
    assert m["pearson"] > 0.99
    # EK-FAC curvature ranks the training digits almost as the exact Hessian does
    assert m["pearson_ekfac_vs_exact"] > 0.95 and m["pearson_ekfac_vs_actual"] > 0.95
    # the digits ranked most influential move the test loss far more than random ones
    top, rand = m["actual"][:8], m["actual"][8:]
    assert min(abs(a) for a in top) > 3 * max(abs(a) for a in rand)

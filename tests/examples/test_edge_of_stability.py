"""examples/edge_of_stability.py: under gradient descent the sharpness rises to 2 / lr
and stays there (Cohen et al., 2021); a small step size keeps it far below. Each run's
sharpness comes from one vmapped ``eigsh`` over the stacked runs."""


def test_sharpness_settles_at_two_over_the_learning_rate(example):
    eos = example("edge_of_stability")
    m = eos.main(["--steps", "600", "--lrs", "0.2", "0.02", "--examples", "300",
                  "--every", "50"])
    big, small = 0, 1
    assert m["edge_start"][big] < 0.8  # it starts below the edge and sharpens up to it
    assert 0.9 < m["edge_last_third_mean"][big] < 1.25
    assert m["edge_last_third_max"][small] < 0.3  # far from its own edge (2 / 0.02)
    assert m["edge_last_third_mean"][small] > m["edge_start"][small]  # still sharpening
    assert all(end < start for start, end in zip(m["loss_start"], m["loss_end"]))

"""examples/deq_digits.py: a DEQ classifier trains on implicit gradients, and at the
trained weights its implicit gradient equals autodiff through a long unrolled iteration."""


def test_deq_learns_digits_with_implicit_gradients(example):
    result = example("deq_digits").main(["--steps", "100"])
    assert result["deq_accuracy"] > 0.85  # chance is 0.1
    assert result["unrolled_accuracy"] > 0.85
    assert result["grad_rel_err"] < 1e-4  # implicit == unrolled to the solve's tolerance
    assert result["grad_cosine"] > 0.9999
    assert 1 <= result["calls_per_step"] <= 40  # stops early, never past max_iter

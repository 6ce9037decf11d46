"""examples/pinn_poisson.py: L-BFGS after Adam brings the PINN close to the exact
solution of its Poisson problem."""


def test_lbfgs_finishes_what_adam_started(example):
    pinn = example("pinn_poisson")
    out = pinn.main(["--adam-steps", "200", "--lbfgs-steps", "100", "--points", "32",
                     "--hidden", "16"])
    # measured: Adam alone 2.4 relative L2 error, then L-BFGS (zoom search) 0.028
    assert out["final_loss"] < out["adam_loss"] / 100
    assert out["final_error"] < 0.05 < out["adam_error"]

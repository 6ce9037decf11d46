"""examples/ddpm_2d.py, ddpm_digits.py, ebm_2d.py, gru_lyapunov.py, wgan_2d.py and
wgan_digits.py run end to end on a tiny config."""

import importlib.util
import json

import pytest

# the PNG needs matplotlib (the "plots" extra); without it the scripts run with --no-plot
PLOT = importlib.util.find_spec("matplotlib") is not None
NO_PLOT = [] if PLOT else ["--no-plot"]


def test_ddpm_2d_tiny(tmp_path, example):
    ddpm = example("ddpm_2d")
    args = [
        "--steps",
        "30",
        "--batch",
        "64",
        "--timesteps",
        "40",
        "--ddim-steps",
        "5",
        "--dpm-steps",
        "4",
        "--samples",
        "64",
        "--hidden",
        "16",
        "--depth",
        "1",
        "--seed",
        "3",
    ]
    m = ddpm.main(args + NO_PLOT + ["--out", str(tmp_path / "a")])
    assert not PLOT or (tmp_path / "a" / "ddpm_2d.png").stat().st_size > 0
    saved = json.loads((tmp_path / "a" / "metrics.json").read_text())
    assert set(saved["energy_distance"]) == {"ddpm", "ddim5", "dpm_solver4", "data_baseline"}
    assert 0 <= saved["modes_covered"]["ddpm"] <= 1
    # deterministic from the seed
    again = ddpm.main(args + ["--out", str(tmp_path / "b"), "--no-plot"])
    assert (
        again["energy_distance"] == m["energy_distance"] and again["final_loss"] == m["final_loss"]
    )


def test_ebm_2d_tiny(tmp_path, example):
    ebm = example("ebm_2d")
    args = [
        "--steps",
        "8",
        "--batch",
        "32",
        "--buffer",
        "128",
        "--langevin-steps",
        "3",
        "--samples",
        "64",
        "--hidden",
        "16",
        "--out",
        str(tmp_path),
    ]
    m = ebm.main(args + NO_PLOT)
    assert not PLOT or (tmp_path / "ebm_2d.png").stat().st_size > 0
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert set(saved["energy_distance"]) == {"replay_buffer", "fresh_langevin_500", "data_baseline"}
    assert saved["final_loss"] == m["final_loss"]


@pytest.mark.parametrize("objective", ["ddpm", "flow"])
def test_ddpm_digits_tiny(tmp_path, example, objective):
    ddpm = example("ddpm_digits")
    args = ["--steps", "12", "--batch", "32", "--timesteps", "20", "--channels", "8",
            "--per-class", "2", "--ddim-steps", "3", "--classifier-steps", "30", "--seed", "1",
            "--objective", objective]
    m = ddpm.main(args + NO_PLOT + ["--out", str(tmp_path / "a")])
    assert not PLOT or (tmp_path / "a" / "samples.png").stat().st_size > 0
    saved = json.loads((tmp_path / "a" / "metrics.json").read_text())
    assert 0 <= saved["samples_classified_as_their_condition"] <= 1
    assert saved["classifier_accuracy_on_real_test_digits"] > 0.5  # 30 steps already learn
    # deterministic from the seed
    again = ddpm.main(args + ["--out", str(tmp_path / "b"), "--no-plot"])
    assert again["final_loss"] == m["final_loss"]
    assert again["samples_classified_as_their_condition"] == m[
        "samples_classified_as_their_condition"]


def test_ddpm_digits_with_guidance_tiny(tmp_path, example):
    """Label dropout in training, then one sampling run per guidance weight; weight 1
    is the plain conditional sampler."""
    ddpm = example("ddpm_digits")
    args = ["--steps", "12", "--batch", "32", "--timesteps", "20", "--channels", "8",
            "--per-class", "2", "--ddim-steps", "3", "--classifier-steps", "30", "--seed", "1",
            "--objective", "flow", "--p-uncond", "0.2", "--no-plot"]
    m = ddpm.main(args + ["--guidance", "1", "3", "--out", str(tmp_path / "a")])
    assert set(m["by_guidance"]) == {"1.0", "3.0"}
    assert m["by_guidance"]["1.0"]["within_class_spread_vs_real"] == m[
        "within_class_spread_vs_real"]
    with pytest.raises(SystemExit, match="needs a model trained with --p-uncond"):
        ddpm.main(args[:-3] + ["--no-plot", "--guidance", "2", "--out", str(tmp_path / "b")])


def test_gru_lyapunov_tiny(tmp_path, example):
    lyap = example("gru_lyapunov")
    args = ["--hidden", "8", "--k", "3", "--steps", "30", "--warmup", "5", "--gains", "0.5,8",
            "--check-steps", "20", "--out", str(tmp_path)]
    m = lyap.main(args + NO_PLOT)
    assert not PLOT or (tmp_path / "lyapunov.png").stat().st_size > 0
    saved = json.loads((tmp_path / "metrics.json").read_text())
    spectra = saved["lyapunov_exponents"]
    assert all(len(v) == 3 and v == sorted(v, reverse=True) for v in spectra.values())
    assert max(spectra["0.5"]) < 0  # small recurrent weights: ordered
    # forward mode through models.GRU == reverse-mode Jacobians through nn.GRU
    assert saved["check_vs_nn_gru_reverse_mode"]["max_abs_difference"] < 1e-10
    assert saved["largest_exponent"] == m["largest_exponent"]


def test_wgan_2d_tiny(tmp_path, example):
    wgan = example("wgan_2d")
    args = ["--steps", "6", "--critic-steps", "2", "--batch", "32", "--hidden", "16",
            "--samples", "64", "--seed", "2"]
    m = wgan.main(args + NO_PLOT + ["--out", str(tmp_path / "a")])
    assert not PLOT or (tmp_path / "a" / "wgan_2d.png").stat().st_size > 0
    saved = json.loads((tmp_path / "a" / "metrics.json").read_text())
    assert set(saved["energy_distance"]) == {"wgan", "data_baseline"}
    assert 0 <= saved["modes_covered"]["wgan"] <= 1
    again = wgan.main(args + ["--out", str(tmp_path / "b"), "--no-plot"])  # one key: same run
    assert again["final_critic_loss"] == m["final_critic_loss"]
    assert again["energy_distance"] == m["energy_distance"]


def test_wgan_digits_tiny(tmp_path, example):
    wgan = example("wgan_digits")
    args = ["--steps", "20", "--critic-steps", "2", "--batch", "32", "--latent", "8",
            "--width", "8", "--per-class", "3", "--classifier-steps", "30", "--seed", "1"]
    m = wgan.main(args + NO_PLOT + ["--out", str(tmp_path / "a")])
    assert not PLOT or (tmp_path / "a" / "samples.png").stat().st_size > 0
    saved = json.loads((tmp_path / "a" / "metrics.json").read_text())
    assert 0 <= saved["samples_classified_as_their_condition"] <= 1
    assert saved["within_class_spread_vs_real"] > 0  # 20 steps: not one image per digit
    again = wgan.main(args + ["--out", str(tmp_path / "b"), "--no-plot"])  # one key: same run
    assert again["final_critic_loss"] == m["final_critic_loss"]
    assert again["within_class_spread_vs_real"] == m["within_class_spread_vs_real"]

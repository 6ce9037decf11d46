"""examples/flow_matching_2d.py: a small run shows OT pairing's straight paths,
MeanFlow's few-step sampling and the consistency models' one-step sampling (one or two
calls already land near the data, where plain flow matching with Euler does not), and a
seed fixes every number."""

import importlib.util
import json

NO_PLOT = [] if importlib.util.find_spec("matplotlib") else ["--no-plot"]
SMALL = ["--steps", "240", "--batch", "128", "--hidden", "64", "--depth", "2",
         "--calls", "1", "2", "32", "--samples", "500", "--nll-points", "200", "--seed", "0"]


def test_ot_pairing_mean_flow_and_consistency_sample_well_in_one_or_two_calls(tmp_path, example):
    fm = example("flow_matching_2d")
    m = fm.main(SMALL + NO_PLOT + ["--out", str(tmp_path / "a")])
    saved = json.loads((tmp_path / "a" / "metrics.json").read_text())
    assert saved["energy_distance"] == m["energy_distance"]
    ed = m["energy_distance"]
    assert set(ed) == {"flow", "flow_ot", "edm", "mean_flow", "ict", "scm", "data_baseline"}
    two, many = "2_calls (euler2)", "32_calls (euler32)"
    assert ed["flow_ot"][two] < 0.1 * ed["flow"][two]
    assert ed["mean_flow"]["2_calls (mean_flow2)"] < 0.1 * ed["flow"][two]
    # one call of a consistency model (iCT; sCM, whose loss takes a jvp of the MLP)
    assert max(ed["ict"]["1_calls (cm1)"], ed["scm"]["1_calls (scm1)"]) < 0.1 * ed["flow"][two]
    # with enough calls every objective gets close: far below the two-step random pairing
    assert max(ed["flow"][many], ed["flow_ot"][many], ed["edm"]["32_calls (heun16)"]) < \
        0.1 * ed["flow"][two]
    # both flows are densities too, and better ones than the best single Gaussian
    nll = m["test_nll"]
    assert max(nll["flow"], nll["flow_ot"]) < nll["single_gaussian"] - 0.3


def test_the_seed_fixes_the_run(tmp_path, example):
    fm = example("flow_matching_2d")
    tiny = ["--steps", "12", "--batch", "32", "--hidden", "16", "--depth", "1",
            "--calls", "2", "--samples", "64", "--nll-points", "16", "--no-plot"]
    a = fm.main(tiny + ["--out", str(tmp_path / "a")])
    b = fm.main(tiny + ["--out", str(tmp_path / "b")])
    assert a["energy_distance"] == b["energy_distance"] and a["final_loss"] == b["final_loss"]

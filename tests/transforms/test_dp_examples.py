"""examples/quickstart.py and examples/dp_sgd.py run end to end with a few steps."""

import importlib.util
import json
import math
from pathlib import Path

import pytest

from torchfn.transforms import rdp_epsilon

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quickstart_loss_falls_and_is_deterministic():
    qs = _load("quickstart")
    a = qs.main(["--steps", "40", "--seed", "1", "--log-every", "20"])
    assert a["loss_last"] < 0.8 * a["loss_first"]
    assert a["test_accuracy"] > 0.3  # 10 classes: chance is 0.1
    b = qs.main(["--steps", "40", "--seed", "1", "--log-every", "20"])
    assert a["losses"] == b["losses"]  # same seed, same run


@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_dp_sgd_writes_metrics_and_plot(tmp_path, method):
    dp = _load("dp_sgd")
    m = dp.main(["--steps", "30", "--eval-every", "10", "--method", method, "--out",
                 str(tmp_path)])
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["test_accuracy"] == m["test_accuracy"]
    assert (tmp_path / "curves.png").stat().st_size > 1000
    assert m["loss_last"] < m["loss_first"]
    assert math.isclose(m["epsilon"], rdp_epsilon(1.2, m["sample_rate"], 30, 1e-5))

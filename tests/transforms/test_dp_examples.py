"""examples/quickstart.py, dp_sgd.py and dp_graphs.py run end to end with a few steps."""

import json
import math

import pytest
import torch

from torchfn import random
from torchfn.transforms import rdp_epsilon


def test_quickstart_loss_falls_and_is_deterministic(example):
    qs = example("quickstart")
    a = qs.main(["--steps", "40", "--seed", "1", "--log-every", "20"])
    assert a["loss_last"] < 0.8 * a["loss_first"]
    assert a["test_accuracy"] > 0.3  # 10 classes: chance is 0.1
    b = qs.main(["--steps", "40", "--seed", "1", "--log-every", "20"])
    assert a["losses"] == b["losses"]  # same seed, same run


@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_dp_sgd_writes_metrics_and_plot(tmp_path, method, example):
    dp = example("dp_sgd")
    m = dp.main(["--steps", "30", "--eval-every", "10", "--method", method, "--out",
                 str(tmp_path)])
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["test_accuracy"] == m["test_accuracy"]
    assert (tmp_path / "curves.png").stat().st_size > 1000
    assert m["loss_last"] < m["loss_first"]
    assert math.isclose(m["epsilon"], rdp_epsilon(1.2, m["sample_rate"], 30, 1e-5))


def test_dp_graphs_learns_from_the_edges_only(tmp_path, example):
    dp = example("dp_graphs")
    tiny = ["--graphs", "400", "--test-graphs", "200", "--steps", "60", "--batch-size", "32",
            "--eval-every", "30"]
    m = dp.main(tiny + ["--out", str(tmp_path / "a")])
    saved = json.loads((tmp_path / "a" / "metrics.json").read_text())
    assert saved["test_accuracy"] == m["test_accuracy"]
    assert math.isclose(m["epsilon"], rdp_epsilon(1.0, 32 / 400, 60, 1e-5))
    assert m["test_accuracy"] > 0.7  # 0.835 at seed 0
    blind = dp.main(tiny + ["--no-edges", "--out", str(tmp_path / "b")])
    assert blind["test_accuracy"] < 0.62  # features alone: chance (0.5 at seed 0)


def test_dp_graphs_data_are_padded_undirected_graphs(example):
    dp = example("dp_graphs")
    x, edges, weight, y = dp.make_graphs(random.key(0), 200, 24)
    assert x.shape == (200, 24, 4) and edges.shape[:2] == (200, 2)
    assert weight.shape == (200, edges.shape[2])
    within, total = torch.zeros(2), torch.zeros(2)
    for g in range(200):
        real = edges[g][:, weight[g] == 1]  # (2, E_g), padding dropped
        pairs = set(map(tuple, real.T.tolist()))
        assert len(pairs) == real.shape[1] and all((j, i) in pairs for i, j in pairs)
        assert all(i != j for i, j in pairs)  # no self loops
        assert (edges[g][:, weight[g] == 0] == 0).all()  # padding points 0 -> 0
        same = (real[0] < 12) == (real[1] < 12)
        within[y[g]] += same.sum()
        total[y[g]] += real.shape[1]
    frac = within / total  # share of edges within a block: ~0.85 community, ~0.48 mixed
    assert frac[1] > 0.75 and 0.35 < frac[0] < 0.6
    signs = (x[..., 0] > 0).float().mean(1)  # the features alone look alike in both classes
    assert abs(signs[y == 1].mean() - signs[y == 0].mean()) < 0.05

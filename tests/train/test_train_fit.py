"""fit: resumed == uninterrupted bit for bit (also after SIGKILL), history, best checkpoint,
Batches addressed by step."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import optree
import pytest
import torch

import torchfn
from torchfn import optim, random
from torchfn.core.checkpoint import load_metadata
from torchfn.train import Batches, NonFiniteLossError, TrainState, fit, make_train_step

SETUP = """
import torch, torch.nn.functional as F, torchfn
from torchfn import optim, random
from torchfn.core.checkpoint import load_metadata
from torchfn.train import Batches, TrainState, make_train_step

def problem():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 5, generator=g)
    y = (x[:, 0] > 0).long()
    params = {"w1": torch.randn(5, 8, generator=g) * 0.5, "b1": torch.zeros(8),
              "w2": torch.randn(8, 2, generator=g) * 0.5}

    def loss_fn(p, model_state, batch, key):
        xb, yb = batch
        keep = random.bernoulli(key, 0.8, (xb.shape[0], 8))     # dropout: uses the step key
        h = torch.tanh(xb @ p["w1"] + p["b1"]) * keep / 0.8
        loss = F.cross_entropy(h @ p["w2"], yb)
        return loss, (model_state, {"acc": ((h @ p["w2"]).argmax(-1) == yb).float().mean()})

    opt = optim.inject_hyperparams(optim.adam)(lr=optim.warmup_cosine(0.05, 3, 20))
    state = TrainState.create(params, opt, key=random.key(0))
    step = make_train_step(loss_fn, opt, has_aux=True)
    data = Batches(random.key(1), (x, y), 8)          # 5 steps per epoch

    def eval_fn(state):
        h = torch.tanh(x @ state.params["w1"] + state.params["b1"])
        return {"val_loss": F.cross_entropy(h @ state.params["w2"], y)}

    return step, state, data, eval_fn
"""
namespace: dict = {}
exec(SETUP, namespace)
problem = namespace["problem"]

KW = dict(eval_every=3, log_every=3, checkpoint_every=2, progress=False)


def assert_states_equal(a, b):
    la, lb = optree.tree_leaves(a), optree.tree_leaves(b)
    assert optree.tree_structure(a) == optree.tree_structure(b)
    for u, v in zip(la, lb):
        assert torch.equal(u, v)


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_resume_equals_uninterrupted(tmp_path):
    step, state, data, eval_fn = problem()
    straight, hist = fit(step, state, data, steps=12, eval_fn=eval_fn,
                         checkpoint_dir=tmp_path / "a", **KW)
    # stop at 7 (mid log-window, between checkpoints: last checkpoint at 7 = the end)
    fit(step, state, data, steps=7, eval_fn=eval_fn, checkpoint_dir=tmp_path / "b", **KW)
    resumed, hist2 = fit(step, state, data, steps=12, eval_fn=eval_fn,
                         checkpoint_dir=tmp_path / "b", resume=True, **KW)
    assert_states_equal(straight, resumed)
    assert hist == hist2
    assert read_jsonl(tmp_path / "b" / "metrics.jsonl") == hist
    assert [r["step"] for r in hist] == [3, 6, 9, 12]
    assert {"loss", "grad_norm", "lr", "acc", "val_loss"} <= set(hist[0])
    # best checkpoint = the state at the row with the lowest val_loss
    best_row = min(hist, key=lambda r: r["val_loss"])
    best = torchfn.load(tmp_path / "b" / "best.safetensors", like={"state": state, "window": {}})
    assert int(best["state"].step) == best_row["step"]
    # resuming a finished run is a no-op
    again, hist3 = fit(step, state, data, steps=12, eval_fn=eval_fn,
                       checkpoint_dir=tmp_path / "b", resume=True, **KW)
    assert_states_equal(again, straight) and hist3 == hist


def test_resume_after_sigkill(tmp_path):
    """A child checkpointing every step is killed -9; resuming equals an uninterrupted run."""
    child = SETUP + textwrap.dedent(f"""
        import time
        step, state, data, eval_fn = problem()
        def slow(i):
            time.sleep(0.1)
            return data(i)
        torchfn.fit(step, state, slow, steps=40, eval_fn=eval_fn, eval_every=3, log_every=3,
                    checkpoint_every=1, checkpoint_dir={str(tmp_path / "killed")!r},
                    progress=False)
    """)
    proc = subprocess.Popen([sys.executable, "-c", child], stderr=subprocess.PIPE)
    last = tmp_path / "killed" / "last.safetensors"
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if last.exists() and load_metadata(last)["torchfn.fit"]["step"] >= 3:
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    killed_at = load_metadata(last)["torchfn.fit"]["step"]
    assert 3 <= killed_at < 40

    step, state, data, eval_fn = problem()
    kw = dict(eval_fn=eval_fn, eval_every=3, log_every=3, progress=False)
    resumed, hist = fit(step, state, data, steps=12, checkpoint_dir=tmp_path / "killed",
                        resume=True, checkpoint_every=1, **kw)
    straight, want = fit(step, state, data, steps=12, **kw)
    if killed_at <= 12:
        assert_states_equal(resumed, straight)
        assert hist == want
    else:  # the child got further than 12 steps
        assert int(resumed.step) == killed_at


def test_history_rows_are_window_means():
    step, state, data, _ = problem()
    _, per_step = fit(step, state, data, steps=6, log_every=1, progress=True)
    _, hist = fit(step, state, data, steps=6, log_every=3, progress=False)
    for row, rows in zip(hist, (per_step[:3], per_step[3:])):
        want = sum(r["loss"] for r in rows) / 3
        assert row["loss"] == pytest.approx(want, rel=1e-6)


def test_nonfinite_from_vmapped_step_raises_naming_the_step():
    def loss_fn(p, s, batch, key):
        return (p["w"] * batch).sum()

    opt = optim.adam(0.1)
    states = torchfn.tree.stack(
        [TrainState.create({"w": torch.ones(2)}, opt, key=random.key(i)) for i in range(2)])
    step = torch.func.vmap(make_train_step(loss_fn, opt), in_dims=(0, None))
    data = lambda i: torch.tensor([1.0, float("nan") if i == 4 else 1.0])
    with pytest.raises(NonFiniteLossError, match="at step 4"):
        fit(step, states, data, steps=10, log_every=5, progress=False)


def test_batches_by_step():
    x = torch.arange(10.0)
    data = Batches(random.key(0), {"x": x, "i": torch.arange(10)}, 3)
    assert len(data) == 3
    epoch0 = torch.cat([data(i)["x"] for i in range(3)])
    assert len(set(epoch0.tolist())) == 9  # no repeats within an epoch
    perm = random.permutation(random.fold_in(random.key(0), 1), 10)
    assert torch.equal(data(4)["x"], x[perm[3:6]])  # epoch 1, batch 1
    assert torch.equal(data(4)["i"].float(), data(4)["x"])
    fresh = Batches(random.key(0), {"x": x, "i": torch.arange(10)}, 3)
    assert torch.equal(fresh(4)["x"], data(4)["x"])  # addressed by step: no hidden position
    ordered = Batches(random.key(0), x, 5, shuffle=False)
    assert torch.equal(ordered(3), x[5:])


def test_bad_input(tmp_path):
    step, state, data, eval_fn = problem()
    with pytest.raises(ValueError, match="steps must be an int >= 1, got 0"):
        fit(step, state, data, steps=0)
    with pytest.raises(ValueError, match="log_every must be an int >= 1"):
        fit(step, state, data, steps=2, log_every=0)
    with pytest.raises(ValueError, match="keep_best mode must be 'min' or 'max', got 'lowest'"):
        fit(step, state, data, steps=2, checkpoint_dir=tmp_path, keep_best=("loss", "lowest"))
    with pytest.raises(ValueError, match="resume=True needs a checkpoint_dir"):
        fit(step, state, data, steps=2, resume=True)
    with pytest.raises(ValueError, match="eval_every=2 needs an eval_fn"):
        fit(step, state, data, steps=2, eval_every=2)
    with pytest.raises(TypeError, match="data must be a callable"):
        fit(step, state, [1, 2], steps=2)
    with pytest.raises(TypeError, match="state must be a TrainState"):
        fit(step, tuple(state), data, steps=2)
    with pytest.raises(ValueError, match="keep_best metric 'nope' is not among"):
        fit(step, state, data, steps=2, checkpoint_dir=tmp_path / "k", keep_best=("nope", "min"),
            progress=False)
    fit(step, state, data, steps=2, checkpoint_dir=tmp_path / "c", progress=False)
    with pytest.raises(ValueError, match="already holds a run"):
        fit(step, state, data, steps=2, checkpoint_dir=tmp_path / "c", progress=False)
    with pytest.raises(ValueError, match="steps=1 is before the state's step 2"):
        fit(step, state, data, steps=1, checkpoint_dir=tmp_path / "c", resume=True,
            progress=False)
    with pytest.raises(ValueError, match="batch_size must be an int in \\[1, 10\\], got 11"):
        Batches(random.key(0), torch.ones(10), 11)
    with pytest.raises(ValueError, match="share the leading dimension"):
        Batches(random.key(0), (torch.ones(10), torch.ones(9)), 2)

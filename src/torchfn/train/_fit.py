"""``fit``: run a train step over data with logging, evaluation, checkpoints and exact resume."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from torchfn.train._state import TrainState
from torchfn.train._step import NonFiniteLossError

__all__ = ["fit"]

_DEFAULT_BEST = ("val_loss", "min")
_LAST, _BEST, _METRICS = "last.safetensors", "best.safetensors", "metrics.jsonl"


class _Default(tuple):
    """Marks ``keep_best`` left at its default (ignored without eval_fn or checkpoint_dir)."""


def _positive(name: str, value: Any, optional: bool = True) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1{' or None' if optional else ''}, "
                         f"got {value!r}")


def _to_python(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.detach()
        if value.is_floating_point():
            value = value.double()
        return value.tolist()
    if isinstance(value, (int, float)):
        return value
    raise TypeError(f"metric values must be tensors or numbers, got {type(value).__name__}")


def _read_history(path: Path, upto: int) -> list[dict[str, Any]]:
    """Rows with ``step <= upto``; a torn last line (killed mid-write) is dropped."""
    rows: list[dict[str, Any]] = []
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            break
        if row.get("step", math.inf) > upto:
            break
        rows.append(row)
    return rows


def _write_history(path: Path, rows: list[dict[str, Any]]) -> None:
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, path)


def _improved(value: float, best: float | None, mode: str) -> bool:
    if best is None or math.isnan(best):
        return not math.isnan(value)
    return value < best if mode == "min" else value > best


def fit(
    step: Callable[[TrainState, Any], tuple[TrainState, dict[str, Any]]],
    state: TrainState,
    data: Callable[[int], Any],
    *,
    steps: int,
    eval_fn: Callable[[TrainState], dict[str, Any]] | None = None,
    eval_every: int | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
    checkpoint_every: int | None = None,
    keep_best: tuple[str, str] | None = _Default(_DEFAULT_BEST),
    log_every: int = 10,
    progress: bool = True,
    resume: bool = False,
) -> tuple[TrainState, list[dict[str, Any]]]:
    """Train ``state`` with ``step`` until ``state.step == steps``.

    Args:
        step: a train step, e.g. from :func:`make_train_step` (possibly
            ``torch.compile``-d or ``vmap``-ped over an ensemble).
        state: the initial :class:`TrainState` (also the template a resumed
            checkpoint is loaded into).
        data: ``data(i) -> batch`` for global step ``i``, e.g.
            :class:`Batches`. Data is addressed by step so that the data
            position is part of the train state and a resumed run sees the
            same batches. (A stateful iterator cannot be resumed exactly:
            wrap one as ``lambda i: next(it)`` only if you do not resume.)
        steps: total number of steps (not additional ones): the loop runs
            from ``state.step`` (or the resumed checkpoint's step) to ``steps``.
        eval_fn: ``eval_fn(state) -> dict`` of metrics, run every
            ``eval_every`` steps and after the last step.
        checkpoint_dir: where ``last.safetensors`` (every ``checkpoint_every``
            steps and after the last step), ``best.safetensors`` and
            ``metrics.jsonl`` go. Checkpoints hold the train state, the data
            position and metadata and are written atomically by
            :func:`torchfn.save`.
        keep_best: ``(metric, "min" | "max")``: save ``best.safetensors``
            whenever a logged row improves this metric (train or eval). The
            default ``("val_loss", "min")`` is skipped without an ``eval_fn``
            or a ``checkpoint_dir``; an explicit one needs a ``checkpoint_dir``
            and must name a reported metric. Only rows on the log/eval grid
            count (not the extra row logged because a run ends off-grid), so a
            resumed run keeps the same best checkpoint.
        log_every: every this many steps, append a row with the mean of the
            step metrics over those steps to the history (and
            ``metrics.jsonl``) and refresh the progress bar's loss and lr.
            After the last step a row is always written (the partial window
            and the final eval).
        progress: show a tqdm progress bar.
        resume: continue from ``checkpoint_dir/last.safetensors`` if it exists
            (state, data position, best metric, history up to that step),
            otherwise start from ``state``. Resumed runs equal uninterrupted
            ones bit for bit (state, history, best checkpoint), also after the
            process was killed. Without ``resume`` a ``checkpoint_dir`` that
            already holds checkpoints is an error.

    Returns:
        ``(state, history)``: the final state and the list of rows, each
        ``{"step": n, <metric>: value, ...}`` after ``n`` steps.

    Raises:
        NonFiniteLossError: a step reported a non-finite loss (from a step run
            under ``vmap``/``torch.compile`` that skipped it), naming the step.

    Example::

        >>> import torch, torchfn
        >>> def loss_fn(params, model_state, batch, key):
        ...     x, y = batch
        ...     return ((x @ params["w"] - y) ** 2).mean()
        >>> x = torch.linspace(-1, 1, 32)[:, None].repeat(1, 2)
        >>> data = torchfn.train.Batches(torchfn.random.key(1), (x, x.sum(1)), 8)
        >>> opt = torchfn.optim.sgd(0.1)
        >>> state = torchfn.TrainState.create({"w": torch.zeros(2)}, opt,
        ...                                   key=torchfn.random.key(0))
        >>> state, history = torchfn.fit(torchfn.make_train_step(loss_fn, opt), state,
        ...                              data, steps=20, log_every=10, progress=False)
        >>> [row["step"] for row in history]
        [10, 20]
    """
    _positive("steps", steps, optional=False)
    _positive("log_every", log_every, optional=False)
    _positive("eval_every", eval_every)
    _positive("checkpoint_every", checkpoint_every)
    if not isinstance(state, TrainState):
        raise TypeError(f"state must be a TrainState, got {type(state).__name__}")
    if not callable(data):
        raise TypeError(
            f"data must be a callable data(step) -> batch (e.g. torchfn.train.Batches), "
            f"got {type(data).__name__}"
        )
    if eval_every is not None and eval_fn is None:
        raise ValueError(f"eval_every={eval_every} needs an eval_fn, got eval_fn=None")
    if checkpoint_dir is None and (checkpoint_every is not None or resume):
        what = f"checkpoint_every={checkpoint_every}" if checkpoint_every else "resume=True"
        raise ValueError(f"{what} needs a checkpoint_dir, got checkpoint_dir=None")
    if isinstance(keep_best, _Default) and (eval_fn is None or checkpoint_dir is None):
        keep_best = None
    if keep_best is not None and checkpoint_dir is None:
        raise ValueError(f"keep_best={keep_best!r} needs a checkpoint_dir, got None")
    if keep_best is not None:
        if not (isinstance(keep_best, tuple) and len(keep_best) == 2
                and isinstance(keep_best[0], str)):
            raise ValueError(f"keep_best must be (metric_name, 'min' | 'max') or None, "
                             f"got {keep_best!r}")
        if keep_best[1] not in ("min", "max"):
            raise ValueError(f"keep_best mode must be 'min' or 'max', got {keep_best[1]!r}")
    from torchfn.core import checkpoint

    ckpt_dir = None if checkpoint_dir is None else Path(checkpoint_dir)
    history: list[dict[str, Any]] = []
    window: dict[str, torch.Tensor] = {}
    count = 0
    best: float | None = None
    first_bad = None  # earliest step reported non-finite (tensor), checked at log time
    seen_log = seen_eval = seen_best = False

    if ckpt_dir is not None:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        last = ckpt_dir / _LAST
        if resume and last.exists():
            state, window, count, best, flush = _restore(last, state, checkpoint)
            at = _step_of(state)
            history = _read_history(ckpt_dir / _METRICS, at)
            if flush and at < steps and history and history[-1]["step"] == at:
                # the stopped run ended off the log/eval grid: drop what it logged only
                # for that reason, so the history equals an uninterrupted run's
                row = {k: v for k, v in history.pop().items() if k not in flush}
                if len(row) > 1:
                    history.append(row)
        elif not resume and (last.exists() or (ckpt_dir / _BEST).exists()):
            raise ValueError(
                f"checkpoint_dir {str(ckpt_dir)!r} already holds a run's checkpoints; pass "
                "resume=True to continue it, or use a new checkpoint_dir"
            )
        _write_history(ckpt_dir / _METRICS, history)

    start = _step_of(state)
    if start > steps:
        raise ValueError(f"steps={steps} is before the state's step {start}")

    from tqdm.auto import tqdm

    bar = tqdm(total=steps, initial=start, disable=not progress, dynamic_ncols=True)
    try:
        for i in range(start, steps):
            state, metrics = step(state, data(i))
            bad = metrics.pop("nonfinite", None)
            if bad is not None:
                here = torch.where(bad.any(), i, -1)
                first_bad = here if first_bad is None else torch.where(first_bad >= 0,
                                                                       first_bad, here)
            for name, value in metrics.items():
                v = value.detach().double() if isinstance(value, torch.Tensor) else \
                    torch.tensor(float(value), dtype=torch.float64)
                window[name] = window[name] + v if name in window else v
            count += 1
            bar.update(1)
            n = i + 1
            final = n == steps
            log_grid = n % log_every == 0
            eval_grid = eval_fn is not None and eval_every is not None and n % eval_every == 0
            row: dict[str, Any] = {}
            flush: list[str] = []  # keys logged only because the run ends here (off-grid)
            if log_grid or final:
                _check_finite(first_bad)
                means = {k: _to_python(v / count) for k, v in window.items()}
                row.update(means)
                if log_grid:
                    window, count = {}, 0
                else:  # keep the window: a resumed run continues it
                    flush += list(means)
            if eval_fn is not None and (eval_grid or final):
                evals = eval_fn(state)
                if not isinstance(evals, dict):
                    raise TypeError(f"eval_fn must return a dict of metrics, got "
                                    f"{type(evals).__name__}")
                evals = {k: _to_python(v) for k, v in evals.items()}
                row.update(evals)
                if not eval_grid:
                    flush += list(evals)
            if row:
                row = {"step": n, **row}
                history.append(row)
                if ckpt_dir is not None:
                    with open(ckpt_dir / _METRICS, "a") as f:
                        f.write(json.dumps(row) + "\n")
                bar.set_postfix({k: row[k] for k in ("loss", "lr") if k in row}, refresh=False)
                if keep_best is not None:
                    name = keep_best[0]
                    seen_log |= log_grid or final
                    seen_eval |= eval_fn is not None and (eval_grid or final)
                    seen_best |= name in row
                    if name in row and name not in flush:
                        best = _maybe_save_best(row, keep_best, best, state, ckpt_dir,
                                                checkpoint)
                    if not seen_best and seen_log and (seen_eval or eval_fn is None):
                        raise ValueError(
                            f"keep_best metric {name!r} is not among the reported "
                            f"metrics {sorted(k for k in row if k != 'step')}"
                        )
            if ckpt_dir is not None and ((checkpoint_every and n % checkpoint_every == 0)
                                         or final):
                _check_finite(first_bad)
                _save(ckpt_dir / _LAST, state, window, count, best, n, checkpoint,
                      flush if final else [])
    finally:
        bar.close()
    return state, history


def _step_of(state: TrainState) -> int:
    """The step count; an ensemble (vmapped) state's members must agree."""
    steps = state.step.reshape(-1)
    if steps.numel() > 1 and not bool((steps == steps[0]).all()):
        raise ValueError(f"state.step: ensemble members are at different steps {steps.tolist()}")
    return int(steps[0])


def _check_finite(first_bad: torch.Tensor | None) -> None:
    if first_bad is not None and int(first_bad) >= 0:
        raise NonFiniteLossError(
            f"non-finite loss or gradient at step {int(first_bad)} (the update was skipped); "
            "lower the learning rate, clip gradients or use a loss scale"
        )


def _maybe_save_best(row, keep_best, best, state, ckpt_dir, checkpoint):
    name, mode = keep_best
    value = row[name]
    if not isinstance(value, (int, float)):
        raise ValueError(f"keep_best metric {name!r} must be a scalar, got {value!r}")
    if _improved(float(value), best, mode):
        best = float(value)
        _save(ckpt_dir / _BEST, state, {}, 0, best, row["step"], checkpoint)
    return best


def _save(path, state, window, count, best, n, checkpoint, flush=()) -> None:
    meta = {
        "torchfn.fit": {
            "step": n,
            "data_position": n,  # data(i) is addressed by step: the position is the step
            "window_count": count,
            "window_names": sorted(window),
            "best": best,
            "flush": list(flush),  # keys of the step-n row logged only because fit ended
        }
    }
    checkpoint.save(path, {"state": state, "window": window}, metadata=meta)


def _restore(path, like: TrainState, checkpoint):
    """``(state, window, count, best)`` from a checkpoint written by :func:`fit`."""
    meta = checkpoint.load_metadata(path)
    info = meta.get("torchfn.fit") if isinstance(meta, dict) else None
    if info is None:
        raise ValueError(f"resume: {path} was not written by torchfn.fit (no 'torchfn.fit' "
                         "metadata)")
    device = like.step.device
    window_like = {k: torch.zeros((), dtype=torch.float64, device=device)
                   for k in info["window_names"]}
    tree = checkpoint.load(path, like={"state": like, "window": window_like})
    return tree["state"], tree["window"], info["window_count"], info["best"], info["flush"]

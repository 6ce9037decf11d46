"""Read a row of handwritten digits with CTC: no segmentation, only the digit sequence.

Each example is a strip 8 pixels tall holding 1 to ``--max-digits`` of the 8x8 digits
side by side, with random gaps. The model reads the strip column by column (T columns of
8 pixels: a "frame" each, as a speech model reads audio frames) and is trained with
``losses.ctc_loss`` against the digits alone: where each digit starts is never given.
A small 1-D conv net gives each column logits over the 10 digits and the blank; greedy
decoding (the argmax per column, repeats merged, blanks dropped) reads the sequence.
Strips past their content are padding: ``input_lengths`` says where each one ends.

The report gives sequence accuracy (every digit right) and the digit error rate (edit
distance over the number of digits) on strips made from held-out digits, against the
untrained model.

``--dp`` trains with DP-SGD instead (``transforms.make_dp_step``): each example's CTC
gradient under ``vmap``, clipped and noised, and the epsilon spent. The privacy unit is
a strip: the strips reuse the training digits, so this is not a guarantee per digit.

    python examples/ctc_digits.py                        # about 30 s on 2 cores
    python examples/ctc_digits.py --dp --batch-size 128  # about 80 s
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from tqdm import tqdm

import torchfn
from torchfn import losses, optim, random
from torchfn.data import load_digits, train_test_split
from torchfn.transforms import make_dp_step, poisson_sample, rdp_epsilon

BLANK = 10  # the digits keep their labels 0-9


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--max-digits", type=int, default=4)
    p.add_argument("--max-gap", type=int, default=3, help="blank columns between digits")
    p.add_argument("--width", type=int, default=64, help="conv channels")
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--dp", action="store_true", help="DP-SGD (per-example clipping, noise)")
    p.add_argument("--clip", type=float, default=1.0, help="DP: per-example L2 clip")
    p.add_argument("--noise-multiplier", type=float, default=0.8, help="DP: sigma")
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def compose(key: torch.Tensor, images: torch.Tensor, labels: torch.Tensor, n: int,
            max_digits: int, max_gap: int) -> tuple[torch.Tensor, ...]:
    """``n`` strips of digits drawn from ``images (M, 8, 8)``: the strips ``(n, T, 8)``
    (column-major: T columns of 8 pixels), the digits ``(n, max_digits)`` (padded with 0),
    their counts ``(n,)`` and each strip's used width ``(n,)``."""
    k_count, k_pick, k_gap = random.split(key, 3)
    counts = random.randint(k_count, (n,), 1, max_digits + 1)
    picks = random.randint(k_pick, (n, max_digits), 0, len(images))
    gaps = random.randint(k_gap, (n, max_digits + 1), 0, max_gap + 1)
    T = max_digits * 8 + (max_digits + 1) * max_gap
    strips = torch.zeros(n, T, 8)
    targets = torch.zeros(n, max_digits, dtype=torch.long)
    used = torch.zeros(n, dtype=torch.long)
    for i in range(n):
        col = int(gaps[i, 0])
        for d in range(int(counts[i])):
            strips[i, col:col + 8] = images[picks[i, d]].T  # (8 columns, 8 pixels)
            targets[i, d] = labels[picks[i, d]]
            col += 8 + int(gaps[i, d + 1])
        used[i] = col
    return strips, targets, counts, used


class ColumnReader(nn.Module):
    """Per-column logits over the digits and the blank: ``(..., T, 8) -> (..., T, 11)``
    (a batch, or one strip under ``vmap``)."""

    def __init__(self, width: int):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv1d(8, width, 5, padding=2), nn.GELU(),
            nn.Conv1d(width, width, 5, padding=2), nn.GELU(),
            nn.Conv1d(width, width, 5, padding=2), nn.GELU(),
            nn.Conv1d(width, BLANK + 1, 1))

    def forward(self, strips: torch.Tensor) -> torch.Tensor:
        return self.net(strips.transpose(-1, -2)).transpose(-1, -2)


def greedy_decode(logits: torch.Tensor, lengths: torch.Tensor) -> list[list[int]]:
    """The argmax per column up to each strip's length, repeats merged, blanks dropped."""
    best = logits.argmax(-1)  # (n, T)
    out = []
    for row, n in zip(best.tolist(), lengths.tolist()):
        seq = [c for t, c in enumerate(row[:n]) if c != BLANK and (t == 0 or c != row[t - 1])]
        out.append(seq)
    return out


def edit_distance(a: list[int], b: list[int]) -> int:
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        cur = [i]
        for j, y in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y)))
        prev = cur
    return prev[-1]


def evaluate(model, params, data) -> dict:
    strips, targets, counts, used = data
    with torch.no_grad():
        read = greedy_decode(model.apply(params, strips), used)
    truth = [t[:c] for t, c in zip(targets.tolist(), counts.tolist())]
    exact = sum(r == t for r, t in zip(read, truth)) / len(truth)
    errors = sum(edit_distance(r, t) for r, t in zip(read, truth)) / sum(map(len, truth))
    return {"sequence_accuracy": exact, "digit_error_rate": errors}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    k_split, k_train, k_test, k_init, k_batch, k_noise = random.split(random.key(args.seed), 6)
    x, y = load_digits()  # (1797, 64) in [0, 1], (1797,)
    (x_tr, y_tr), (x_te, y_te) = train_test_split(k_split, x, y, test_fraction=0.2)
    train = compose(k_train, x_tr.view(-1, 8, 8), y_tr, 4096, args.max_digits, args.max_gap)
    test = compose(k_test, x_te.view(-1, 8, 8), y_te, 1000, args.max_digits, args.max_gap)

    model = torchfn.Model(ColumnReader(args.width))
    params = model.init(k_init)
    before = evaluate(model, params, test)

    def batch_loss(params, strips, targets, counts, used):  # a batch: (B, T, 8), ...
        return losses.ctc_loss(model.apply(params, strips), targets, used, counts,
                               blank=BLANK)

    def example_loss(params, strip, target, count, used):  # one strip (T, 8): DP-SGD
        return losses.ctc_loss(model.apply(params, strip), target, used, count, blank=BLANK)

    n = len(train[0])
    if args.dp:
        q = args.batch_size / n
        dp = make_dp_step(example_loss, optim.adam(args.lr), l2_norm_clip=args.clip,
                          noise_multiplier=args.noise_multiplier,
                          expected_batch_size=args.batch_size, key=k_noise)
        opt_state = dp.init(params)
    else:
        tx = optim.adam(args.lr)
        opt_state = tx.init(params)
        value_and_grad = torch.func.grad_and_value(batch_loss)

    t0 = time.perf_counter()
    history = []
    for step in tqdm(range(args.steps), desc="ctc", mininterval=0.5):
        key = random.fold_in(k_batch, step)
        if args.dp:
            idx = poisson_sample(key, n, q)
            params, opt_state, loss = dp.step(params, opt_state, *(t[idx] for t in train))
        else:
            idx = random.randint(key, (args.batch_size,), 0, n)
            grads, loss = value_and_grad(params, *(t[idx] for t in train))
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optim.apply_updates(params, updates)
        history.append(float(loss))

    after = evaluate(model, params, test)
    k = max(1, min(50, args.steps // 5))
    metrics = {
        "before": before,
        "after": after,
        "loss_first": sum(history[:k]) / k,
        "loss_last": sum(history[-k:]) / k,
        "seconds": time.perf_counter() - t0,
    }
    if args.dp:
        metrics["epsilon"] = rdp_epsilon(args.noise_multiplier, q, args.steps, args.delta)
    print(f"loss {metrics['loss_first']:.3f} -> {metrics['loss_last']:.3f}; held-out strips: "
          f"sequence accuracy {before['sequence_accuracy']:.3f} -> "
          f"{after['sequence_accuracy']:.3f}, digit error rate "
          f"{before['digit_error_rate']:.3f} -> {after['digit_error_rate']:.3f}"
          + (f"; ({metrics['epsilon']:.2f}, {args.delta:g})-DP" if args.dp else "")
          + f" ({metrics['seconds']:.0f} s)")
    return metrics


if __name__ == "__main__":
    main()

"""Exact sampling distributions of small language models, by enumeration, for the
speculative decoders' tests."""

from __future__ import annotations

import itertools

import torch

from torchfn.models._generate import filter_logits


def target_distribution(model, params, prompt, n, temperature, **filters):
    """P(continuation) for every continuation of n tokens, by enumeration (float64), each
    step drawn from the filtered (top-k / top-p / min-p) conditional."""
    vocab = model.apply(params, prompt).shape[-1]
    conts = torch.tensor(list(itertools.product(range(vocab), repeat=n)))  # (vocab^n, n)
    seqs = torch.cat((prompt.expand(len(conts), -1), conts), 1)
    logits = filter_logits(model.apply(params, seqs[:, :-1]).double(), temperature, **filters)
    logp = torch.log_softmax(logits, -1)
    p = prompt.shape[-1]
    picked = logp[:, p - 1:].gather(-1, conts[..., None])[..., 0]  # (vocab^n, n)
    return conts, picked.sum(-1).exp()

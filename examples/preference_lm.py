"""Preference tuning of a small causal LM: supervised fine-tuning, then DPO or GRPO.

A prompt is one token ``x0``; a completion is an arithmetic progression after it,
``x0 + s, x0 + 2s, ...`` (mod the vocabulary) with a step ``s`` in 1..4. The SFT data
uses every step alike, so the tuned model picks a step about uniformly and then keeps it.
Preference tuning then changes which step it picks, and nothing else:

* ``--method dpo``: pairs of completions of one prompt, step 1 preferred to a step of
  2-4 (``losses.dpo`` on the completions' log-probabilities under the policy and under
  the frozen SFT model, the reference), plus ``--nll-weight`` times the chosen
  completions' per-token NLL (RPO, Pang et al. 2024; default 1). With ``--nll-weight 0``
  (pure DPO) the model stops sampling steps 2-4 but moves much of their mass to first
  tokens no completion ever had: about 0.4-0.5 of its samples stay well-formed, where
  with the NLL term all of them do and all take step 1;
* ``--method grpo``: no pairs, a reward: 1 for a well-formed progression of step 2, else 0.
  Each step samples ``--group`` completions of each prompt from the policy
  (``models.generate`` with a key), scores them, and takes one step of ``losses.grpo``
  with ``losses.group_advantages`` (KL to the SFT model, weight ``--beta``);
  ``--baseline leave-one-out`` is RLOO's advantage, ``--ratio sequence`` GSPO's clipped
  sequence-level ratio.

The report gives, before and after: the share of sampled completions with the wanted
step, and the share that are well-formed progressions; for DPO also the implicit
reward's accuracy on held-out pairs.

    python examples/preference_lm.py --method dpo
    python examples/preference_lm.py --method grpo
"""

from __future__ import annotations

import argparse

import torch
from tqdm import tqdm

import torchfn
from torchfn import losses, optim, random
from torchfn.models import TransformerEncoder, generate

VOCAB, LENGTH, STEPS = 16, 6, (1, 2, 3, 4)  # tokens, completion length, progression steps


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--method", choices=["dpo", "grpo"], default="dpo")
    p.add_argument("--sft-steps", type=int, default=150)
    p.add_argument("--steps", type=int, default=60, help="preference-tuning steps")
    p.add_argument("--batch", type=int, default=64, help="sequences (DPO: pairs) a step")
    p.add_argument("--group", type=int, default=8, help="GRPO: completions per prompt")
    p.add_argument("--baseline", choices=["group", "leave-one-out"], default="group",
                   help="GRPO: the group's mean and std, or RLOO's leave-one-out mean")
    p.add_argument("--ratio", choices=["token", "sequence"], default="token",
                   help="GRPO: per-token ratios, or GSPO's one per completion")
    p.add_argument("--beta", type=float, default=None,
                   help="DPO's beta (default 0.1) or GRPO's KL weight (default 0.04)")
    p.add_argument("--nll-weight", type=float, default=1.0,
                   help="DPO: add this times the chosen completions' per-token NLL (RPO)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def progressions(start: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """``(B,)`` starts and steps -> ``(B, 1 + LENGTH)`` sequences: the prompt, then the
    completion."""
    return (start[:, None] + step[:, None] * torch.arange(LENGTH + 1)) % VOCAB


def read_step(seqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each completion's first step ``(B,)`` and whether it is a well-formed progression."""
    step = (seqs[:, 1] - seqs[:, 0]) % VOCAB
    return step, (seqs == progressions(seqs[:, 0], step)).all(1)


def completion_log_probs(model, params, seqs: torch.Tensor) -> torch.Tensor:
    """``log p(completion | prompt)`` ``(B, LENGTH)`` per token: the targets are positions
    1.. of the sequence."""
    return losses.token_log_probs(model.apply(params, seqs)[:, :-1], seqs[:, 1:])


def sample_report(model, params, key, n: int = 512) -> dict:
    """Sampled completions (temperature 1) of random prompts: their steps' shares and the
    share that are well-formed."""
    k_prompt, k_sample = random.split(key)
    prompts = random.randint(k_prompt, (n, 1), 0, VOCAB)
    with torch.no_grad():
        seqs = generate(model, params, prompts, LENGTH, key=k_sample)
    step, ok = read_step(seqs)
    return {"shares": [float(((step == s) & ok).float().mean()) for s in STEPS],
            "well_formed": float(ok.float().mean())}


def sft(model, params, key, steps: int, batch: int, lr: float) -> dict:
    """Maximum likelihood on progressions of every step alike."""
    opt = optim.adam(lr)
    state = opt.init(params)

    def loss_fn(p, seqs):
        return -completion_log_probs(model, p, seqs).mean()

    for i in tqdm(range(steps), desc="sft", mininterval=0.5):
        k_start, k_step = random.split(random.fold_in(key, i))
        seqs = progressions(random.randint(k_start, (batch,), 0, VOCAB),
                            torch.tensor(STEPS)[random.randint(k_step, (batch,), 0, 4)])
        grads = torch.func.grad(loss_fn)(params, seqs)
        updates, state = opt.update(grads, state, params)
        params = optim.apply_updates(params, updates)
    return params


def preference_pairs(key, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` pairs of completions of one prompt: step 1 preferred to a step of 2-4, drawn
    alike: (chosen, rejected), each ``(n, 1 + LENGTH)``."""
    k_start, k_step = random.split(key)
    start = random.randint(k_start, (n,), 0, VOCAB)
    return progressions(start, torch.ones_like(start)), \
        progressions(start, random.randint(k_step, (n,), 2, 5))


def dpo(model, params, ref, key, args) -> tuple[dict, dict]:
    beta = 0.1 if args.beta is None else args.beta
    opt = optim.adam(args.lr)
    state = opt.init(params)

    def logp(p, seqs):  # (B,) the completion's log-probability
        return completion_log_probs(model, p, seqs).sum(-1)

    def loss_fn(p, chosen, rejected, ref_chosen, ref_rejected):
        c = logp(p, chosen)
        loss = losses.dpo(c, logp(p, rejected), ref_chosen, ref_rejected, beta=beta)
        return loss - args.nll_weight * c.mean() / LENGTH  # RPO: + NLL of the chosen

    for i in tqdm(range(args.steps), desc="dpo", mininterval=0.5):
        chosen, rejected = preference_pairs(random.fold_in(key, i), args.batch)
        with torch.no_grad():
            ref_chosen, ref_rejected = logp(ref, chosen), logp(ref, rejected)
        grads = torch.func.grad(loss_fn)(params, chosen, rejected, ref_chosen, ref_rejected)
        updates, state = opt.update(grads, state, params)
        params = optim.apply_updates(params, updates)
    chosen, rejected = preference_pairs(random.fold_in(key, -1), 512)  # held out
    with torch.no_grad():
        margin = (logp(params, chosen) - logp(ref, chosen)) \
            - (logp(params, rejected) - logp(ref, rejected))
    return params, {"reward_accuracy": float((margin > 0).float().mean())}


def grpo(model, params, ref, key, args) -> tuple[dict, dict]:
    beta = 0.04 if args.beta is None else args.beta
    opt = optim.adam(args.lr)
    state = opt.init(params)
    prompts_per_step = max(1, args.batch // args.group)

    def loss_fn(p, seqs, advantages, ref_logps):
        mask = torch.ones(seqs.shape[0], LENGTH, dtype=torch.bool)  # every token generated
        return losses.grpo(completion_log_probs(model, p, seqs), advantages, mask,
                           ref_logps=ref_logps, beta=beta, ratio=args.ratio)

    rewarded = []
    for i in tqdm(range(args.steps), desc="grpo", mininterval=0.5):
        k_prompt, k_sample = random.split(random.fold_in(key, i))
        prompts = random.randint(k_prompt, (prompts_per_step, 1), 0, VOCAB)
        with torch.no_grad():  # G samples of each prompt from the current policy
            seqs = generate(model, params, prompts.repeat_interleave(args.group, 0), LENGTH,
                            key=k_sample)  # (P G, 1 + LENGTH)
            step, ok = read_step(seqs)
            reward = ((step == 2) & ok).to(torch.float32)
            rloo = args.baseline == "leave-one-out"
            advantages = losses.group_advantages(reward.view(-1, args.group), scale=not rloo,
                                                 leave_one_out=rloo).flatten()
            ref_logps = completion_log_probs(model, ref, seqs)
        rewarded.append(float(reward.mean()))
        grads = torch.func.grad(loss_fn)(params, seqs, advantages, ref_logps)
        updates, state = opt.update(grads, state, params)
        params = optim.apply_updates(params, updates)
    return params, {"train_reward_first": rewarded[0], "train_reward_last": rewarded[-1]}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    init_key, sft_key, tune_key, eval_key = random.split(random.key(args.seed), 4)
    model = torchfn.Model(TransformerEncoder(
        dim=48, heads=4, depth=2, vocab_size=VOCAB, out_dim=VOCAB, causal=True,
        position_embedding="rotary", norm="rms", mlp="swiglu", bias=False))
    params = sft(model, model.init(init_key), sft_key, args.sft_steps, args.batch, 1e-2)
    ref = {n: t.detach().clone() for n, t in params.items()}  # the frozen SFT model
    before = sample_report(model, ref, eval_key)
    tune = dpo if args.method == "dpo" else grpo
    params, extra = tune(model, params, ref, tune_key, args)
    after = sample_report(model, params, eval_key)
    wanted = 1 if args.method == "dpo" else 2
    print(f"SFT model: steps 1-4 sampled {', '.join(f'{x:.2f}' for x in before['shares'])}; "
          f"well-formed {before['well_formed']:.2f}")
    print(f"after {args.method}: steps 1-4 sampled "
          f"{', '.join(f'{x:.2f}' for x in after['shares'])}; well-formed "
          f"{after['well_formed']:.2f} (wanted: step {wanted})")
    if "reward_accuracy" in extra:
        print(f"held-out pairs ranked right by the implicit reward: "
              f"{extra['reward_accuracy']:.2f}")
    else:
        print(f"mean reward of the samples: {extra['train_reward_first']:.2f} at the first "
              f"step, {extra['train_reward_last']:.2f} at the last")
    return {"before": before, "after": after, "wanted": wanted,
            "wanted_before": before["shares"][wanted - 1],
            "wanted_after": after["shares"][wanted - 1], **extra}


if __name__ == "__main__":
    main()

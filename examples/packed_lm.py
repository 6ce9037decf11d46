"""Packed sequences: a causal Transformer LM trained on documents packed into rows.

Short documents waste most of a padded batch. Packing several into each row fills it,
and ``segment_ids`` keeps them apart: a token attends only within its document
(``torchfn.kernels.attention``'s document masking, O(N) memory, the other documents'
key blocks skipped) and its position restarts at the document's start. Each document
then trains exactly as if it were alone in its row (``tests/models`` checks that).

The documents are synthetic: ``t[i + 1] = (t[i] + step) mod V`` with a random start and
step per document, so a token is predictable from two earlier ones of *its own*
document and not at all from another's. Packed rows leak nothing when the model is
right, which the per-document accuracy shows.

``--optimizer`` picks the training rule: Adam (the default), Muon for the blocks'
weight matrices with AdamW for the rest (``optim.partition``), schedule-free AdamW
(evaluated at its averaged params, ``optim.schedule_free_eval_params``), SOAP,
AdEMAMix (its alpha and beta3 warmed up over 300 steps) or ADOPT.

``--remat`` recomputes each block's activations in the backward: ``full`` keeps only
the blocks' inputs, ``dots`` also the projections' outputs (``checkpoint_policies.
dots_saveable``). The training run is the same to the bit, for less memory.

``--positions rotary`` uses rotary position embeddings instead of a learned table, and
``--kv-heads 1`` shares one key/value head among the four query heads (multi-query).

After training, the model continues held-out progressions from prompts of 3 to 8 tokens,
batched with left padding (``models.generate`` with ``prompt_mask``; one cached model call
per new token). Greedy continuation accuracy is the share of the new tokens that follow
the progression, and of the progressions continued without a single error.

    python examples/packed_lm.py --steps 300 --seed 0 [--optimizer muon] [--remat dots]
        [--positions rotary] [--kv-heads 1] [--draft-dim 32] [--dim 256 --depth 4]
        [--experts 4 [--routing deepseek]] [--latent-attention [--sparse-topk 8]] [--mtp 1]
        [--mixer gated_deltanet | mamba2 | mamba]

``--experts 4`` makes every block's MLP a mixture of 4 experts, each token routed to
2 (``models.MoE``, Mixtral's routing), trained with Switch's load-balancing loss
(``losses.moe_load_balance`` on the routers' logits, weight ``--aux-weight``); the
report gives each expert's share of the held-out tokens.

``--routing deepseek`` routes as DeepSeek-V3: sigmoid scores and a selection bias per
expert (router *state*, not a parameter) that ``models.moe_bias_update`` moves after each
step toward balanced loads, ``--bias-rate`` a step, with no load-balancing loss
(``--aux-weight`` defaults to 0 there). ``--latent-attention`` gives every block
DeepSeek's multi-head latent attention (``models.LatentAttention``: keys and values from
one small latent per token, which is all the KV cache holds; rotary positions).
``--sparse-topk 8`` makes it DeepSeek Sparse Attention (DeepSeek-V3.2): a lightning
indexer (``models.LightningIndexer``) picks each query's 8 keys, and its own loss (the KL
of the attention's distribution against the indexer's, ``return_indexer_loss=True``),
added to the model's, trains it alone; the report gives that loss's first and last.

``--mtp 1`` adds DeepSeek-V3's multi-token prediction: one more block
(``models.MultiTokenPrediction``) predicts the token after next from the model's states
and the next token's embedding, trained by ``losses.multi_token_prediction`` (weight
``--mtp-weight``); the report gives its held-out accuracy, and decodes with the depths
drafting (``models.mtp_speculative_generate``, self-speculative decoding): the model's own
greedy output, in fewer of its calls.

``--mixer gated_deltanet`` (or ``mamba2``, ``mamba``) makes every block but the last a
linear-attention block with a fixed-size state (``models.GatedDeltaNet``, Qwen3-Next's;
``models.Mamba2``; ``models.Mamba``):
a hybrid stack, the last block attention. The packed documents stay apart there too: each
starts from a zero state (``segment_ids`` reset the state inside the chunked scan), and
decoding carries each block's state in the cache instead of its keys.

``--draft-dim 32`` also trains a one-block model of width 32 on the same batches and
decodes with it as the draft (``models.speculative_generate``): the output equals the
model's own greedy decoding, in fewer calls of the model.
"""

from __future__ import annotations

import argparse
import functools
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

import torchfn
from torchfn import checkpoint_policies, losses, optim, random
from torchfn.models import (
    TransformerEncoder,
    generate,
    moe_bias_update,
    mtp_speculative_generate,
    speculative_generate,
)

VOCAB, PAD = 32, -1  # token ids; the segment id of a row's unused tail


def _muon_labels(params: dict) -> dict:
    """Muon for the blocks' 2-D weights; AdamW for embeddings, the head and 1-D leaves."""
    return {k: "muon" if k.startswith("blocks.") and v.ndim == 2 else "adamw"
            for k, v in params.items()}


OPTIMIZERS = {
    "adam": lambda lr: optim.adam(lr),
    "muon": lambda lr: optim.partition(
        {"muon": optim.muon(0.02, weight_decay=0.0), "adamw": optim.adamw(lr, weight_decay=0.0)},
        _muon_labels),
    "schedule_free": lambda lr: optim.schedule_free_adamw(lr, warmup_steps=20),
    "soap": lambda lr: optim.soap(lr, weight_decay=0.0),
    "ademamix": lambda lr: optim.ademamix(lr, warmup=300),
    "adopt": lambda lr: optim.adopt(lr),
}


REMAT = {"none": False, "full": True, "dots": checkpoint_policies.dots_saveable}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--rows", type=int, default=8, help="packed rows per batch")
    p.add_argument("--row-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--optimizer", choices=list(OPTIMIZERS), default="adam")
    p.add_argument("--remat", choices=list(REMAT), default="none",
                   help="recompute each block's activations in the backward")
    p.add_argument("--positions", choices=["learned", "rotary"], default="learned")
    p.add_argument("--kv-heads", type=int, default=4, help="key/value heads (4 query heads)")
    p.add_argument("--dim", type=int, default=64, help="the model's width (4 heads)")
    p.add_argument("--depth", type=int, default=2, help="the model's blocks")
    p.add_argument("--draft-dim", type=int, default=0,
                   help="also train a one-block draft of this width; decode speculatively")
    p.add_argument("--experts", type=int, default=0,
                   help="a mixture of this many experts (top 2) per block; 0: dense MLPs")
    p.add_argument("--aux-weight", type=float, default=None,
                   help="weight of the experts' load-balancing loss (default 0.02; 0 with "
                        "--routing deepseek)")
    p.add_argument("--routing", choices=["mixtral", "deepseek"], default="mixtral",
                   help="softmax top-2 (Mixtral), or sigmoid scores with a balancing bias")
    p.add_argument("--bias-rate", type=float, default=1e-3,
                   help="--routing deepseek: the selection bias's step per training step")
    p.add_argument("--latent-attention", action="store_true",
                   help="DeepSeek's multi-head latent attention in every block")
    p.add_argument("--sparse-topk", type=int, default=0,
                   help="--latent-attention: DeepSeek Sparse Attention, each query's keys "
                        "picked by a trained indexer; 0: dense")
    p.add_argument("--index-weight", type=float, default=1.0,
                   help="--sparse-topk: the indexer loss's weight (0: the indexer untrained)")
    p.add_argument("--mtp", type=int, default=0,
                   help="DeepSeek-V3's multi-token prediction depth (needs --positions "
                        "rotary)")
    p.add_argument("--mtp-weight", type=float, default=0.3,
                   help="--mtp: the multi-token prediction loss's weight (DeepSeek-V3: 0.3)")
    p.add_argument("--mixer", choices=["attention", "gated_deltanet", "mamba2", "mamba"],
                   default="attention", help="the token mixer of every block but the last")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=50)
    return p.parse_args(argv)


def documents(key, n: int) -> list[torch.Tensor]:
    """``n`` documents of 6..40 tokens, each an arithmetic progression mod VOCAB."""
    k_len, k_start, k_step = random.split(key, 3)
    lengths = random.randint(k_len, (n,), 6, 41).tolist()
    starts = random.randint(k_start, (n,), 0, VOCAB)
    steps = random.randint(k_step, (n,), 1, 6)
    return [(starts[i] + steps[i] * torch.arange(lengths[i])) % VOCAB for i in range(n)]


def pack(docs: list[torch.Tensor], rows: int, row_len: int):
    """Greedy packing: (tokens (rows, row_len), segment ids (rows, row_len), documents used).
    Unused tails get token 0 and segment id PAD (their loss is masked out)."""
    tokens = torch.zeros(rows, row_len, dtype=torch.long)
    ids = torch.full((rows, row_len), PAD, dtype=torch.long)
    used, r, fill = 0, 0, 0
    for doc in docs:
        if fill + len(doc) > row_len:
            r, fill = r + 1, 0
            if r == rows:
                break
        tokens[r, fill:fill + len(doc)] = doc
        ids[r, fill:fill + len(doc)] = used
        fill, used = fill + len(doc), used + 1
    return tokens, ids, used


def continuation_accuracy(model, params, key, n: int = 64, new: int = 16):
    """Greedy continuations of ``n`` progressions from left-padded prompts of 3..8 tokens:
    (share of new tokens right, share of progressions continued without an error)."""
    k_len, k_start, k_step = random.split(key, 3)
    plen = random.randint(k_len, (n, 1), 3, 9)  # (n, 1)
    start = random.randint(k_start, (n, 1), 0, VOCAB)
    step = random.randint(k_step, (n, 1), 1, 6)
    index = torch.arange(8 + new) - 8 + plen  # (n, 8 + new): prompt ends at column 8
    tokens = (start + step * index.clamp(min=0)) % VOCAB
    mask = index[:, :8] >= 0  # (n, 8): False at the left padding
    prompt = torch.where(mask, tokens[:, :8], 0)
    with torch.no_grad():
        out = generate(model, params, prompt, new, prompt_mask=mask)  # (n, 8 + new)
    right = out[:, 8:] == tokens[:, 8:]
    return float(right.float().mean()), float(right.all(-1).float().mean())


def speculative_report(model, params, draft, d_params, key, n: int = 32, new: int = 16):
    """Greedy decoding of ``n`` progressions (prompts of 6 tokens) by the model alone and
    with a draft proposing (``draft=None``: the model's own MTP depths, all of them): whether
    they agree, the drafts' acceptance, the model's calls, the times."""
    k_start, k_step = random.split(key)
    start = random.randint(k_start, (n, 1), 0, VOCAB)
    step = random.randint(k_step, (n, 1), 1, 6)
    prompt = (start + step * torch.arange(6)) % VOCAB  # (n, 6)
    with torch.no_grad():
        t0 = time.perf_counter()
        plain = generate(model, params, prompt, new)
        t1 = time.perf_counter()
        if draft is None:
            fast, info = mtp_speculative_generate(model, params, prompt, new, return_stats=True)
        else:
            fast, info = speculative_generate(model, params, draft, d_params, prompt, new,
                                              lookahead=4, return_stats=True)
        t2 = time.perf_counter()
    return {"equal": bool(torch.equal(plain, fast)),
            "acceptance": info["accepted"] / info["proposed"],
            "target_calls": info["target_calls"], "seconds": t2 - t1, "plain_seconds": t1 - t0}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    deepseek = args.routing == "deepseek" and args.experts > 0
    aux_weight = args.aux_weight if args.aux_weight is not None else 0.0 if deepseek else 0.02
    if args.latent_attention and args.positions != "rotary":
        raise ValueError("--latent-attention needs --positions rotary")
    if args.mtp and args.positions != "rotary":
        raise ValueError("--mtp needs --positions rotary")
    if args.sparse_topk and not args.latent_attention:
        raise ValueError("--sparse-topk needs --latent-attention")
    if args.mixer != "attention" and (args.latent_attention or args.draft_dim):
        raise ValueError("--mixer takes neither --latent-attention nor --draft-dim (a "
                         "recurrent state cannot drop a draft's rejected tokens)")
    linear = None  # the linear-attention blocks' settings: heads of dim / 4
    if args.mixer == "gated_deltanet":
        linear = dict(heads=4, key_dim=args.dim // 4, value_dim=args.dim // 4, chunk=32)
    elif args.mixer == "mamba2":
        linear = dict(kind="mamba2", heads=4, head_dim=args.dim // 2, state_dim=16, chunk=32)
    elif args.mixer == "mamba":
        linear = dict(kind="mamba", state_dim=16, chunk=32)
    init_key, data_key = random.split(random.key(args.seed))
    net = TransformerEncoder(
        dim=args.dim, heads=4, depth=args.depth, vocab_size=VOCAB, out_dim=VOCAB,
        causal=True, max_len=args.row_len, remat=REMAT[args.remat],
        kv_heads=None if args.latent_attention else args.kv_heads,
        position_embedding=args.positions, experts=args.experts or None,
        moe_options=dict(scoring="sigmoid", router_bias=True) if deepseek else None,
        latent_attention=dict(kv_rank=args.dim // 2, rope_dim=8, nope_dim=args.dim // 4,
                              v_dim=args.dim // 4,
                              **(dict(q_rank=args.dim // 2, indexer=dict(
                                  heads=4, head_dim=16, topk=args.sparse_topk))
                                 if args.sparse_topk else {}))
        if args.latent_attention else None,
        linear_attention=linear, mtp=args.mtp,
        layer_linear=[i < args.depth - 1 for i in range(args.depth)] if linear else None)
    model = torchfn.Model(net)
    params, state = model.init(init_key), model.init_state()  # state: the routers' biases
    initial = params  # (updates make new dicts: this one stays as it was)
    run = functools.partial(model.apply, state=state) if state else model

    def loss_and_acc(params, tokens, ids, model=model, moe=args.experts > 0, state=state,
                     sparse=bool(args.sparse_topk), mtp=args.mtp > 0):
        aux, router, index = 0.0, (), 0.0  # tokens, ids: (R, N)
        logits, *extra = model.apply(params, tokens, segment_ids=ids, state=state or None,
                                     return_router_logits=moe, return_indexer_loss=sparse,
                                     return_mtp=mtp) \
            if moe or sparse or mtp else (model.apply(params, tokens, segment_ids=ids,
                                                      state=state or None),)
        if moe:  # the routers' logits (R, N, E) per block, for balancing
            router = extra.pop(0)
            if aux_weight:
                aux = aux_weight * losses.moe_load_balance(router, 2, mask=ids != PAD)
        if sparse:  # the indexers' KL losses, one per block: they train the indexers alone
            index = sum(extra.pop(0))
            aux = aux + args.index_weight * index
        mtp_acc = torch.zeros(())
        if mtp:  # the depths' logits (R, N - k, V): position t predicts token t + k + 1
            ahead = extra.pop(0)
            aux = aux + args.mtp_weight * losses.multi_token_prediction(
                ahead, tokens, mask=ids != PAD, segment_ids=ids)
            counted = (ids[:, 2:] == ids[:, :-2]) & (ids[:, 2:] != PAD)  # t, t + 2: one doc
            mtp_acc = ((ahead[0][:, :-1].argmax(-1) == tokens[:, 2:]) & counted).sum() \
                / counted.sum()
        logits = logits[:, :-1]  # (R, N - 1, V)
        target = tokens[:, 1:]
        # predict the next token of the same document, from its third token on (the step
        # needs two tokens to be known)
        same = (ids[:, 1:] == ids[:, :-1]) & (ids[:, 1:] != PAD)
        third = torch.cat([torch.zeros_like(same[:, :1]), same[:, :-1]], 1) & same
        loss = F.cross_entropy(logits.transpose(1, 2), target, reduction="none")
        loss = (loss * same).sum() / same.sum() + aux
        acc = ((logits.argmax(-1) == target) & third).sum() / third.sum()
        index = index.detach() if sparse else torch.zeros(())
        return loss, (acc, tuple(r.detach() for r in router), index, mtp_acc)

    grad_fn = torch.func.grad_and_value(loss_and_acc, has_aux=True)
    draft = None
    if args.draft_dim:  # a one-block draft model for speculative decoding
        draft = torchfn.Model(TransformerEncoder(
            dim=args.draft_dim, heads=2, depth=1, vocab_size=VOCAB, out_dim=VOCAB, causal=True,
            max_len=args.row_len, position_embedding=args.positions))
        d_params = draft.init(random.fold_in(init_key, 1))
        d_opt = optim.adam(args.lr)
        d_state = d_opt.init(d_params)
        draft_grad = torch.func.grad(lambda *a, **k: loss_and_acc(*a, **k, state={},
                                                                  sparse=False, mtp=False),
                                     has_aux=True)
    opt = OPTIMIZERS[args.optimizer](args.lr)
    opt_state = opt.init(params)
    history, index_losses, tokens_seen, start = [], [], 0, time.perf_counter()
    pbar = tqdm(range(args.steps), desc="packed_lm", mininterval=0.5)
    for step in pbar:
        docs = documents(random.fold_in(data_key, step), 8 * args.rows * args.row_len // 23)
        tokens, ids, used = pack(docs, args.rows, args.row_len)
        grads, (loss, (acc, router, index, _)) = grad_fn(params, tokens, ids)
        index_losses.append(float(index))
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optim.apply_updates(params, updates)
        if deepseek:  # each expert's load this step moves its bias (no gradient)
            for i, logits in enumerate(router):
                name = f"blocks.{i}.mlp.router_bias"
                load = net.blocks[i].mlp.expert_load(logits[ids != PAD], state[name])
                state[name] = moe_bias_update(state[name], load, args.bias_rate)
        if draft is not None:  # the draft learns from the same batches
            d_grads, _ = draft_grad(d_params, tokens, ids, model=draft, moe=False)
            d_updates, d_state = d_opt.update(d_grads, d_state, d_params)
            d_params = optim.apply_updates(d_params, d_updates)
        history.append((float(loss) - args.index_weight * index_losses[-1], float(acc)))
        tokens_seen += int((ids != PAD).sum())
        pbar.set_postfix(loss=f"{float(loss):.3f}", acc=f"{float(acc):.3f}", docs=used)
        if step % args.log_every == 0 or step == args.steps - 1:
            tqdm.write(f"step {step:4d}  loss {float(loss):.4f}  next-token accuracy "
                       f"{float(acc):.3f}  ({used} documents in {args.rows} rows, "
                       f"{float((ids != PAD).float().mean()):.0%} of slots used)")

    # held out: fresh documents, the accuracy from each document's third token on
    tokens, ids, _ = pack(documents(random.fold_in(data_key, 10**6), 400), args.rows,
                          args.row_len)
    if args.optimizer == "schedule_free":  # evaluate at the average x, not at y
        params = optim.schedule_free_eval_params(opt_state, params)
    with torch.no_grad():
        _, (test_acc, _, _, mtp_acc) = loss_and_acc(params, tokens, ids)
    seconds = time.perf_counter() - start
    shares = []
    if args.experts:  # each expert's share of the held-out tokens' first choices, per block
        with torch.no_grad():
            _, router = model.apply(params, tokens, segment_ids=ids, state=state,
                                    return_router_logits=True)
        for i, r in enumerate(router):  # the choice as routed: with the bias, if any
            first = net.blocks[i].mlp.select(r[ids != PAD], state.get(
                f"blocks.{i}.mlp.router_bias"))[1][:, 0]
            shares.append(torch.bincount(first, minlength=args.experts).div(
                len(first)).tolist())
    index_report = {}
    if args.sparse_topk:  # the held-out KL, trained indexers against their initial params
        untrained = {**params, **{n: t for n, t in initial.items() if ".indexer." in n}}
        with torch.no_grad():
            for name, p in (("index_loss_held_out", params),
                            ("index_loss_held_out_untrained", untrained)):
                index_report[name] = float(sum(model.apply(
                    p, tokens, segment_ids=ids, state=state or None,
                    return_indexer_loss=True)[-1]))
    token_acc, whole_acc = continuation_accuracy(run, params, random.fold_in(data_key, -1))
    spec = {}
    if draft is not None:
        spec = speculative_report(run, params, draft, d_params, random.fold_in(data_key, -2))
    mtp_spec = {}
    if args.mtp:  # the model's own MTP depths as the draft
        mtp_spec = {f"mtp_{n}": v for n, v in speculative_report(
            run, params, None, None, random.fold_in(data_key, -2)).items()}
    k = max(1, min(20, len(history) // 5))
    first = sum(h[0] for h in history[:k]) / k
    last = sum(h[0] for h in history[-k:]) / k
    print(f"{args.optimizer}: loss {first:.4f} -> {last:.4f}; held-out next-token accuracy "
          f"{float(test_acc):.3f}; {tokens_seen / seconds:,.0f} real tokens/s")
    print(f"greedy continuations (16 tokens, KV cache): {token_acc:.3f} of tokens right, "
          f"{whole_acc:.3f} of progressions without an error")
    if args.mtp:
        print(f"multi-token prediction: held-out accuracy of the token after next "
              f"{float(mtp_acc):.3f}")
        print(f"self-speculative decoding (its {args.mtp} MTP depth(s) drafting, greedy): "
              f"{mtp_spec['mtp_acceptance']:.2f} of drafts accepted, "
              f"{mtp_spec['mtp_target_calls']} model calls for 16 tokens, output equal to "
              f"plain decoding: {mtp_spec['mtp_equal']}; {mtp_spec['mtp_seconds']:.2f} s "
              f"against {mtp_spec['mtp_plain_seconds']:.2f} s")
    if args.sparse_topk:
        print(f"indexer loss (KL, summed over blocks): {index_losses[0]:.4f} -> "
              f"{sum(index_losses[-k:]) / k:.4f}; held out "
              f"{index_report['index_loss_held_out']:.4f} (the untrained indexers: "
              f"{index_report['index_loss_held_out_untrained']:.4f})")
    for i, share in enumerate(shares):
        print(f"block {i}: experts' shares of the tokens' first choices "
              f"{', '.join(f'{x:.2f}' for x in share)}")
    if spec:
        print(f"speculative decoding (draft dim {args.draft_dim}, 4 tokens a round, greedy): "
              f"{spec['acceptance']:.2f} of draft tokens accepted, "
              f"{spec['target_calls']} target calls for 16 tokens, output equal to plain "
              f"decoding: {spec['equal']}; {spec['seconds']:.2f} s against "
              f"{spec['plain_seconds']:.2f} s")
    return {"loss_first": first, "loss_last": last, "test_accuracy": float(test_acc),
            "continuation_accuracy": token_acc, "continuation_exact": whole_acc,
            "expert_shares": shares, "router_bias": {n: t.tolist() for n, t in state.items()},
            "index_loss_first": index_losses[0],
            "index_loss_last": sum(index_losses[-k:]) / k, **index_report,
            "mtp_accuracy": float(mtp_acc),
            **spec, **mtp_spec}


if __name__ == "__main__":
    main()

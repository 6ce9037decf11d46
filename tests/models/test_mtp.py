"""DeepSeek-V3's multi-token prediction (``TransformerEncoder(mtp=D)``, ``return_mtp``,
``losses.multi_token_prediction``): each depth is its formula on the model's final
states, packed documents stay apart, the loss is a loop of cross-entropies, and it
composes with ``vmap(grad)``."""

from __future__ import annotations

import pytest
import torch

import torchfn
from torchfn import losses, random
from torchfn.models import StaticKVCache, TransformerEncoder, generate

KW = dict(dim=16, heads=2, depth=2, vocab_size=11, out_dim=11, causal=True, norm="rms",
          position_embedding="rotary", mlp_hidden=24)


def lm(mtp=2, **kw):
    """A float64 causal LM with ``mtp`` depths, its params (each moved by 0.1 N(0, 1))
    and tokens ``(2, 9)``."""
    model = torchfn.Model(TransformerEncoder(**KW, mtp=mtp, **kw).double())
    params = model.init(random.key(0))  # the norms moved off 1, so that each one counts
    params = {n: t + 0.1 * random.normal(random.key(i), t.shape, t.dtype)
              for i, (n, t) in enumerate(params.items())}
    tokens = torch.randint(0, 11, (2, 9), generator=torch.Generator().manual_seed(1))
    return model, params, tokens


def test_each_depth_is_its_formula_on_the_previous_states():
    """Depth ``k`` at ``t``: its block on ``W [rms(E x[t + k]) | rms(h_{k-1}(t))]`` (the
    model's final normalised states for ``k = 1``, the previous depth's block output
    after), then its norm and the shared head; the main logits are unchanged."""
    model, params, tokens = lm()
    logits, mtp = model.apply(params, tokens, return_mtp=True)
    torch.testing.assert_close(logits, model.apply(params, tokens), rtol=0, atol=0)
    trunk = torchfn.Model(TransformerEncoder(**dict(KW, out_dim=None)).double())
    h = trunk.apply({n: t for n, t in params.items() if not n.startswith(("mtp.", "head."))},
                    tokens)  # (B, N, dim): after the final norm
    rms = torch.nn.functional.rms_norm
    embed = params["embed.weight"][tokens]
    for k in (1, 2):
        p = {n.removeprefix(f"mtp.{k - 1}."): t for n, t in params.items()
             if n.startswith(f"mtp.{k - 1}.")}
        m = 9 - k
        joined = torch.cat((rms(embed[:, k:], (16,), p["enorm.weight"]),
                            rms(h[:, :m], (16,), p["hnorm.weight"])), -1)
        block = torchfn.Model(TransformerEncoder(**KW, mtp=2).double().mtp[k - 1].block)
        h = block.apply({n.removeprefix("block."): t for n, t in p.items()
                         if n.startswith("block.")}, joined @ p["proj.weight"].T)
        want = rms(h, (16,), p["norm.weight"]) @ params["head.weight"].T + params["head.bias"]
        assert mtp[k - 1].shape == (2, m, 11)
        torch.testing.assert_close(mtp[k - 1], want, rtol=1e-12, atol=1e-12)


def test_packed_documents_and_left_padding_give_each_alone():
    """Two documents in a row (``segment_ids``) give each one's depth-1 logits alone,
    the second's positions from 0 again; a left-padded row gives the unpadded one's."""
    model, params, tokens = lm(mtp=1)
    seg = torch.tensor([[0] * 5 + [1] * 4] * 2)
    _, (packed,) = model.apply(params, tokens, segment_ids=seg, return_mtp=True)
    _, (first,) = model.apply(params, tokens[:, :5], return_mtp=True)
    _, (second,) = model.apply(params, tokens[:, 5:], return_mtp=True)
    torch.testing.assert_close(packed[:, :4], first, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(packed[:, 5:], second, rtol=1e-12, atol=1e-12)
    pad = torch.ones(1, 9, dtype=torch.bool)
    pad[0, :3] = False
    positions = (torch.arange(9) - 3).clamp_min(0)[None]
    _, (padded,) = model.apply(params, tokens[1:], pad, positions=positions, return_mtp=True)
    _, (alone,) = model.apply(params, tokens[1:, 3:], return_mtp=True)
    torch.testing.assert_close(padded[:, 3:], alone, rtol=1e-12, atol=1e-12)


def test_loss_is_a_loop_of_cross_entropies_and_composes_with_vmap_grad():
    """The mean over depths of the mean cross-entropy over the counted targets (both
    tokens real, one document), written as a loop; ``vmap(grad)`` equals a loop of
    ``grad`` and reaches the depths' params and the shared embedding and head."""
    model, params, tokens = lm()
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[0, :2] = False
    seg = torch.tensor([[0] * 9, [0] * 4 + [1] * 5])
    _, mtp = model.apply(params, tokens, mask, segment_ids=seg, return_mtp=True)
    per_depth = []
    for k, logits in enumerate(mtp, start=1):
        ces = [torch.nn.functional.cross_entropy(logits[b, t], tokens[b, t + k + 1])
               for b in range(2) for t in range(9 - k - 1)
               if mask[b, t] and mask[b, t + k + 1] and seg[b, t] == seg[b, t + k + 1]]
        per_depth.append(torch.stack(ces).mean())
    torch.testing.assert_close(losses.multi_token_prediction(mtp, tokens, mask=mask,
                                                             segment_ids=seg),
                               torch.stack(per_depth).mean(), rtol=1e-12, atol=0)

    def loss(p, row):
        return losses.multi_token_prediction(model.apply(p, row[None], return_mtp=True)[1],
                                             row[None])

    per = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, tokens)
    for b in range(2):
        one = torch.func.grad(loss)(params, tokens[b])
        for n in params:
            torch.testing.assert_close(per[n][b], one[n], rtol=1e-10, atol=1e-12)
    assert all(per[n].abs().max() > 0 for n in ("mtp.1.proj.weight", "embed.weight",
                                                "head.weight"))
    assert per["blocks.0.attn.qkv.weight"].abs().max() > 0  # through h_0


def test_decoding_ignores_the_depths():
    """``generate`` with a growing or a static cache (which holds the model's blocks
    alone) gives the tokens of the same model without its depths."""
    model, params, tokens = lm()
    plain = torchfn.Model(TransformerEncoder(**KW).double())
    main = {n: t for n, t in params.items() if not n.startswith("mtp.")}
    want = generate(plain, main, tokens[:, :4], 5)
    assert torch.equal(generate(model, params, tokens[:, :4], 5), want)
    cache = StaticKVCache.allocate(model, 2, 9, dtype=torch.float64)
    assert len(cache.keys) == KW["depth"]
    assert torch.equal(generate(model, params, tokens[:, :4], 5, cache=cache), want)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="mtp must be an int >= 0, got -1"):
        TransformerEncoder(**KW, mtp=-1)
    with pytest.raises(ValueError, match="mtp needs token input, an output head and no "
                                         "learned positions"):
        TransformerEncoder(**dict(KW, position_embedding="learned"), mtp=1)
    model, params, tokens = lm()
    plain = torchfn.Model(TransformerEncoder(**KW).double())
    with pytest.raises(ValueError, match="return_mtp needs mtp >= 1 and no cache; got mtp=0"):
        plain.apply(plain.init(random.key(0)), tokens, return_mtp=True)
    with pytest.raises(ValueError, match="return_mtp needs more than mtp = 2 tokens, got 2"):
        model.apply(params, tokens[:, :2], return_mtp=True)
    _, mtp = model.apply(params, tokens, return_mtp=True)
    with pytest.raises(ValueError, match=r"depth 2's logits must be \(B, N - 2, V\) = "
                                         r"\(2, 7, V\)"):
        losses.multi_token_prediction([mtp[0], mtp[0]], tokens)
    with pytest.raises(ValueError, match=r"mask must be \(B, N\) = \(2, 9\)"):
        losses.multi_token_prediction(mtp, tokens, mask=torch.ones(9, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"tokens must be an int tensor \(B, N\)"):
        losses.multi_token_prediction(mtp, tokens.double())

"""Checks the checkpoint-loader tests share: the round trip back to a Hugging Face
checkpoint, and a folder saved here that ``transformers`` loads with the same logits."""

import functools

import torch

import torchfn
from torchfn.models import from_pretrained, save_pretrained


def assert_round_trip_and_reload(module, params, back, sd, folder, config, atol, state=None,
                                 **load):
    """``back`` (the exporter's output for ``params`` and ``state``) is the checkpoint
    ``sd`` bit for bit; ``from_pretrained(folder)`` reads ``params`` and ``state``; and
    ``params`` moved a little (as training would), written by ``save_pretrained``, load in
    ``transformers`` (``AutoModelForCausalLM.from_pretrained(..., **load)``, float64) with
    the logits they give here."""
    import transformers

    state = state or {}
    assert set(back) == set(sd) and all(torch.equal(back[n], sd[n]) for n in sd)
    _, from_folder, read_state, _ = from_pretrained(folder)
    assert all(torch.equal(from_folder[n], params[n]) for n in params)
    assert set(read_state) == set(state) and all(torch.equal(read_state[n], state[n])
                                                 for n in state)
    moved = {n: t + 0.01 * torch.randn(t.shape, dtype=t.dtype,
                                       generator=torch.Generator().manual_seed(3))
             for n, t in params.items()}
    out = folder / "trained"
    out.mkdir()
    save_pretrained(out, config, moved, state)
    again = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float64, **load).eval()
    tokens = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = again(tokens).logits.double()  # (Mamba-2 returns float32 logits)
    torch.testing.assert_close(torchfn.Model(module).apply(moved, tokens, state=state or None),
                               want, rtol=0, atol=atol)


def hf_checkpoint(kind, config, folder, seed=0, init=None, **build):
    """A float64 transformers model of ``model_type`` ``kind`` and ``config`` with random
    weights (norms included: each moved by 0.1 N(0, 1), or ``init(p)`` in place), saved
    with ``save_pretrained`` to ``folder``; returns it, its config dict and the state
    dict as the checkpoint on disk holds it."""
    import transformers
    from safetensors.torch import load_file

    config = transformers.AutoConfig.for_model(kind, **config)
    torch.manual_seed(seed)  # transformers' own init draws from the global generator
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float64, **build)
    with torch.no_grad():
        for p in model.parameters():
            init(p) if init is not None else p.add_(0.1 * torch.randn_like(p))
    model.eval()
    model.save_pretrained(folder)
    return model, config.to_dict(), load_file(folder / "model.safetensors")


def assert_left_padded_generation_matches(hf, model, params, steps=8):
    """Rows of 8, 5 and 2 real tokens padded on the left: ``generate`` with
    ``prompt_mask`` equals transformers' greedy ``generate`` on each row alone."""
    from torchfn.models import generate

    prompt = torch.randint(3, 50, (3, 8), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(3, 8, dtype=torch.bool)
    mask[1, :3] = mask[2, :6] = False
    got = generate(model, params, prompt.masked_fill(~mask, 0), steps, prompt_mask=mask)
    for row in range(3):
        with torch.no_grad():
            want = hf.generate(prompt[row:row + 1, mask[row]], max_new_tokens=steps,
                               do_sample=False, eos_token_id=None)
        assert torch.equal(got[row:row + 1, -steps:], want[:, -steps:])


def assert_same_logits_caches_and_tokens(hf, module, params, atol, steps=10, use_cache=True,
                                         state=None):
    """Logits of 20 tokens (whole, and through the growing cache from a prefill of 7),
    and ``steps`` greedy tokens after a prompt of 6 from both caches, equal to
    transformers' (its generation without its cache where ``use_cache=False``); the
    model's ``state`` bound where it has one."""
    from _cached import logits_through_cache

    from torchfn.models import StaticKVCache, generate

    model = functools.partial(torchfn.Model(module).apply, state=state or None)
    tokens = torch.randint(3, 50, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(tokens).logits.double()  # (Mamba-2 returns float32 logits)
        greedy = hf.generate(tokens[:, :6], attention_mask=torch.ones_like(tokens[:, :6]),
                             max_new_tokens=steps, do_sample=False, eos_token_id=None,
                             use_cache=use_cache)
    torch.testing.assert_close(model(params, tokens), want, rtol=0, atol=atol)
    torch.testing.assert_close(logits_through_cache(model, params, tokens, 7), want, rtol=0,
                               atol=atol)
    assert torch.equal(generate(model, params, tokens[:, :6], steps), greedy)
    static = StaticKVCache.allocate(module, 2, 6 + steps, dtype=torch.float64)
    assert torch.equal(generate(model, params, tokens[:, :6], steps, cache=static), greedy)


def assert_router_logits_and_aux_loss_match(hf, module, params, top_k, atol=1e-6):
    """``return_router_logits=True`` gives transformers' ``router_logits`` (each router's,
    in its order, on the real tokens of left-padded rows), and ``losses.moe_load_balance``
    over them with the padding masked is its ``aux_loss`` (its routers run in float32:
    ``atol``)."""
    from torchfn import losses

    tokens = torch.randint(3, 50, (2, 9), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, :4] = False
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        out = hf(tokens, attention_mask=mask.long(), position_ids=positions,
                 output_router_logits=True)
        _, logits = torchfn.Model(module).apply(params, tokens, mask, positions=positions,
                                                return_router_logits=True)
    assert len(logits) == len(out.router_logits)
    for ours, theirs in zip(logits, out.router_logits):
        torch.testing.assert_close(ours[mask], theirs.reshape(ours.shape)[mask].to(ours.dtype),
                                   rtol=0, atol=atol)
    torch.testing.assert_close(losses.moe_load_balance(logits, top_k, mask=mask),
                               out.aux_loss.to(torch.float64), rtol=1e-6, atol=0)


def run_as_an_extra_layer(hf, sd, layer, x, folder, **config_changes):
    """transformers' own decoder layer holding ``layer``'s tensors (a layer's names after
    ``model.layers.{i}.``), run on ``x`` ``(B, m, dim)`` with causal attention at
    positions ``0 .. m - 1``: the layer is made the last of a copy of ``hf``'s model one
    layer deeper (``config_changes`` set on that copy's config), saved to ``folder``."""
    import copy

    import transformers
    from safetensors.torch import save_file

    n = hf.config.num_hidden_layers
    cfg = copy.deepcopy(hf.config)
    cfg.num_hidden_layers = n + 1
    for name, value in config_changes.items():
        setattr(cfg, name, value)
    cfg.save_pretrained(folder)
    save_file({**sd, **{f"model.layers.{n}.{k}": t for k, t in layer.items()}},
              folder / "model.safetensors")
    big = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float64, experts_implementation="eager",
        attn_implementation="eager").eval()
    b, m = x.shape[:2]
    positions = torch.arange(m)[None].expand(b, -1)
    mask = torch.full((m, m), torch.finfo(torch.float64).min, dtype=torch.float64).triu(1)
    with torch.no_grad():
        out = big.model.layers[n](x, attention_mask=mask[None, None], position_ids=positions,
                                  position_embeddings=big.model.rotary_emb(x, positions))
    return out[0] if isinstance(out, tuple) else out

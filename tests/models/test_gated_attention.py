"""Gated attention (Qiu et al. 2025): ``MultiHeadAttention(output_gate=True)`` multiplies
each head's output feature by ``sigmoid(x W_gate)``, ``output_gate="head"`` each head's
whole output by one gate; both against attention written out in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchfn
from torchfn import random
from torchfn.models import MultiHeadAttention, TransformerEncoder


def written_out(params, x, heads, kv_heads, hd, gate):
    """Causal grouped-query attention from the params, gated per feature or per head."""
    b, n, _ = x.shape
    q, k, v = (x @ params["qkv.weight"].T + params["qkv.bias"]).split(
        [heads * hd, kv_heads * hd, kv_heads * hd], -1)
    q = q.view(b, n, heads, hd).transpose(1, 2)
    k = k.view(b, n, kv_heads, hd).transpose(1, 2).repeat_interleave(heads // kv_heads, 1)
    v = v.view(b, n, kv_heads, hd).transpose(1, 2).repeat_interleave(heads // kv_heads, 1)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, N, D)
    g = torch.sigmoid(x @ params["gate.weight"].T + params["gate.bias"])  # (B, N, H [D])
    o = o.transpose(1, 2)  # (B, N, H, D)
    o = o * (g[..., None] if gate == "head" else g.view(b, n, heads, hd))
    return o.flatten(-2) @ params["out.weight"].T + params["out.bias"]


@pytest.mark.parametrize("gate", [True, "head"])
def test_gates_equal_attention_written_out(gate):
    layer = torchfn.Model(MultiHeadAttention(24, 4, kv_heads=2, causal=True,
                                             output_gate=gate).double())
    params = {n: t + 0.1 * random.normal(random.key(i), t.shape, t.dtype)
              for i, (n, t) in enumerate(layer.init(random.key(0)).items())}
    assert params["gate.weight"].shape == ((4, 24) if gate == "head" else (24, 24))
    x = random.normal(random.key(9), (2, 7, 24), dtype=torch.float64)
    torch.testing.assert_close(layer.apply(params, x), written_out(params, x, 4, 2, 6, gate),
                               rtol=1e-10, atol=1e-10)


def test_the_encoder_takes_a_head_gate_and_decodes_with_it():
    model = torchfn.Model(TransformerEncoder(dim=16, heads=4, depth=2, vocab_size=11,
                                             out_dim=11, causal=True, attn_gate="head",
                                             position_embedding="rotary").double())
    params = model.init(random.key(0))
    assert params["blocks.0.attn.gate.weight"].shape == (4, 16)
    tokens = random.randint(random.key(1), (2, 9), 0, 11)
    from torchfn.models import KVCache
    first, cache = model.apply(params, tokens[:, :5], cache=KVCache())
    second, _ = model.apply(params, tokens[:, 5:], cache=cache)
    torch.testing.assert_close(torch.cat((first, second), 1), model.apply(params, tokens),
                               rtol=1e-10, atol=1e-10)


def test_a_bad_gate_is_named():
    with pytest.raises(ValueError, match="output_gate must be False, True .* or 'head'"):
        MultiHeadAttention(16, 4, output_gate="feature")

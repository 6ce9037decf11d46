"""A sparse mixture-of-experts feed-forward layer (Mixtral, Switch Transformer)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from torchfn.models._mlp import SquaredReLU, SwiGLU, _check_dims

__all__ = ["MoE", "moe_bias_update"]


def _batched_transform_active() -> bool:
    """True under ``vmap``, ``torch.compile`` or a dispatch mode (``make_fx``, fake
    tensors): where the expert groups' data-dependent sizes cannot be read."""
    if torch.compiler.is_compiling():
        return True
    if torch.utils._python_dispatch._get_current_dispatch_mode() is not None:
        return True
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    return any(i.key() == TransformType.Vmap for i in retrieve_all_functorch_interpreters())


class MoE(nn.Module):
    """Mixture of experts: each token goes through the ``top_k`` of ``experts``
    feed-forward networks its router scores highest, their outputs weighted by the
    router's probabilities. ``(..., dim) -> (..., dim)``.

    Routing as Mixtral's: ``p = softmax(router(x))`` over the experts ``(T, E)``, the
    ``top_k`` largest kept, renormalised to sum to 1 (``normalize=False``: kept as they
    are, as Qwen-MoE's default; ``normalize_eps``: divided by their sum plus it, as LFM2's
    ``1e-6``). DeepSeek-V3's routing: ``scoring="sigmoid"``
    (independent scores), ``groups`` / ``topk_groups`` (the experts split into groups,
    only the best ``topk_groups`` groups compete, ranked by the sum of their two best
    scores, or with ``group_score="max"`` by their best as DeepSeek-V2), ``routed_scale``
    (the weights' factor) and ``router_bias=True``: a buffer added to the scores for the
    choice only, which :func:`moe_bias_update` moves toward balanced loads without an
    auxiliary loss.
    Every token is computed (no capacity, no dropped tokens),
    unless ``capacity_factor`` is given: then each expert takes at most
    ``C = ceil(capacity_factor * T * top_k / E)`` of the ``T`` tokens of a call, first
    choices before second ones and in token order within each (GShard's priority), and
    an assignment beyond that adds nothing (the residual carries the token; Switch
    Transformer, GShard). Its buffers have fixed shapes ``(E, C, dim)``: the same code,
    ``capacity_factor * top_k / experts`` of the dense work, runs in eager mode, under
    ``vmap`` (per-sample gradients at sparse cost) and under ``torch.compile``.
    The experts are SwiGLU (``mlp="swiglu"``, as Mixtral), GELU or squared-ReLU
    (``"relu2"``, not gated: Nemotron-H) MLPs, without biases;
    their weights are stacked: ``gate`` / ``up`` ``(E, hidden, dim)``, ``down``
    ``(E, dim, hidden)``. gpt-oss's experts: ``mlp="swiglu_clamp"`` (the gate clamped
    above and the up projection both ways at ``swiglu_limit``, then ``(up + 1) * g *
    sigmoid(swiglu_alpha * g)``), ``expert_bias=True`` (``up_bias`` / ``gate_bias``
    ``(E, hidden)``, ``down_bias`` ``(E, dim)``) and ``logit_bias=True`` (a bias on the
    router's logits, ``router.bias``); its softmax over the top-k logits is the default
    routing (renormalised top-k probabilities are the same numbers).

    ``scoring="sparsemixer"``: Phi-3.5-MoE's choice (SparseMixer, Liu et al. 2024) as it
    runs at inference: the best expert by logit, weighted by its softmax over the experts
    whose logits lie within a relative ``2 * sparsemixer_eps`` of the best (``(best - l)
    / max(|l|, best) <= 2 eps``); then the best of the rest, weighted the same way among
    the rest, and so on for ``top_k`` rounds; not renormalised. The training-time
    estimator (Gumbel sampling and Heun's third-order gradient) is not reproduced: the
    same deterministic choice runs in training, differentiable through its softmaxes.

    ``weights_on="input"``: the routing weight scales each expert's input instead of its
    output, ``sum_e f_e(w_e x)`` for ``sum_e w_e f_e(x)`` (Llama 4, with
    ``scoring="sigmoid", normalize=False`` and one expert a token).

    ``shared_hidden``: also one shared expert of that width that every token goes
    through, added to the routed experts' output (DeepSeekMoE, Qwen-MoE); with
    ``shared_gate=True`` it is scaled by ``sigmoid(w . x)`` per token (Qwen2-MoE);
    ``shared_combine="average"`` averages the two instead of adding them (Cohere2-MoE).
    ``output_bias=True``: a bias ``out_bias`` ``(dim,)`` added to the mixture's output
    (JetMoE).

    Two exact computations of the same function. In eager mode (also under ``grad``,
    ``jvp``, ``jacrev``), tokens are sorted by expert and each expert runs on its own
    tokens only: ``top_k / experts`` of the dense cost. Under ``vmap`` and
    ``torch.compile``, where the groups' sizes cannot be data-dependent, every expert
    runs on every token and the unchosen ones get weight 0: the same values (up to
    rounding), ``experts / top_k`` times the work.

    ``forward(x, return_router_logits=True)`` returns ``(out, logits)`` with the router's
    logits ``(..., E)``, for :func:`torchfn.losses.moe_load_balance` and
    :func:`torchfn.losses.router_z_loss`.

    Example::

        >>> import torch
        >>> import torchfn
        >>> from torchfn.models import MoE
        >>> model = torchfn.Model(MoE(dim=8, hidden=16, experts=4, top_k=2))
        >>> params = model.init(torchfn.random.key(0))
        >>> sorted((n, tuple(p.shape)) for n, p in params.items())
        [('down', (4, 8, 16)), ('gate', (4, 16, 8)), ('router.weight', (4, 8)), ('up', (4, 16, 8))]
        >>> out, logits = model.apply(params, torch.ones(2, 5, 8), return_router_logits=True)
        >>> out.shape, logits.shape                            # (B, N, dim), (B, N, E)
        (torch.Size([2, 5, 8]), torch.Size([2, 5, 4]))
    """

    def __init__(self, dim: int, hidden: int, experts: int, top_k: int = 2, *,
                 mlp: str = "swiglu", normalize: bool = True, shared_hidden: int | None = None,
                 shared_gate: bool = False, capacity_factor: float | None = None,
                 scoring: str = "softmax", groups: int | None = None,
                 topk_groups: int | None = None, group_score: str = "top2",
                 routed_scale: float = 1.0, router_bias: bool = False,
                 logit_bias: bool = False, expert_bias: bool = False,
                 swiglu_limit: float = 7.0, swiglu_alpha: float = 1.702,
                 weights_on: str = "output", normalize_eps: float = 0.0,
                 sparsemixer_eps: float = 0.01, shared_combine: str = "sum",
                 output_bias: bool = False) -> None:
        super().__init__()
        if isinstance(normalize_eps, bool) or not isinstance(normalize_eps, (int, float)) \
                or not normalize_eps >= 0:
            raise ValueError(f"normalize_eps must be a number >= 0, got {normalize_eps!r}")
        self.normalize_eps = float(normalize_eps)
        if weights_on not in ("output", "input"):
            raise ValueError(f"weights_on must be 'output' or 'input', got {weights_on!r}")
        self.weights_on = weights_on
        _check_dims(dim=dim, hidden=hidden, experts=experts, top_k=top_k)
        if shared_combine not in ("sum", "average"):
            raise ValueError(f"shared_combine must be 'sum' or 'average', got "
                             f"{shared_combine!r}")
        self.shared_combine = shared_combine
        if shared_hidden is not None:
            _check_dims(shared_hidden=shared_hidden)
        elif shared_gate:
            raise ValueError("shared_gate needs shared_hidden (a shared expert to gate)")
        if top_k > experts:
            raise ValueError(f"top_k must be <= experts = {experts}, got top_k={top_k}")
        if mlp not in ("swiglu", "gelu", "relu2", "swiglu_clamp"):
            raise ValueError(f"mlp must be 'swiglu', 'gelu', 'relu2' or 'swiglu_clamp', got "
                             f"{mlp!r}")
        for name, value in (("swiglu_limit", swiglu_limit), ("swiglu_alpha", swiglu_alpha)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        self.swiglu_limit, self.swiglu_alpha = float(swiglu_limit), float(swiglu_alpha)
        if mlp == "swiglu_clamp" and shared_hidden is not None:
            raise ValueError("a shared expert takes mlp='swiglu' or 'gelu', not 'swiglu_clamp'")
        if capacity_factor is not None and (isinstance(capacity_factor, bool) or not
                                            isinstance(capacity_factor, (int, float))
                                            or not capacity_factor > 0):
            raise ValueError(f"capacity_factor must be a number > 0 or None, got "
                             f"{capacity_factor!r}")
        self.capacity_factor = capacity_factor
        if scoring not in ("softmax", "sigmoid", "sparsemixer"):
            raise ValueError(f"scoring must be 'softmax', 'sigmoid' or 'sparsemixer', got "
                             f"{scoring!r}")
        if isinstance(sparsemixer_eps, bool) or not isinstance(sparsemixer_eps, (int, float)) \
                or not sparsemixer_eps >= 0:
            raise ValueError(f"sparsemixer_eps must be a number >= 0, got {sparsemixer_eps!r}")
        if scoring == "sparsemixer" and (groups is not None or router_bias):
            raise ValueError("scoring='sparsemixer' takes neither groups nor router_bias")
        self.sparsemixer_eps = float(sparsemixer_eps)
        if (groups is None) != (topk_groups is None):
            raise ValueError(f"give groups and topk_groups together, got groups={groups!r}, "
                             f"topk_groups={topk_groups!r}")
        if groups is not None:
            _check_dims(groups=groups, topk_groups=topk_groups)
            if experts % groups or experts // groups < 2 or topk_groups > groups \
                    or top_k > topk_groups * (experts // groups):
                raise ValueError(f"groups must divide experts = {experts} into groups of >= 2, "
                                 f"topk_groups <= groups and top_k <= the experts of "
                                 f"topk_groups groups; got groups={groups}, topk_groups="
                                 f"{topk_groups}, top_k={top_k}")
        if group_score not in ("top2", "max"):
            raise ValueError(f"group_score must be 'top2' or 'max', got {group_score!r}")
        self.scoring, self.groups, self.topk_groups = scoring, groups, topk_groups
        self.group_score = group_score
        self.routed_scale = float(routed_scale)
        if router_bias:  # DeepSeek-V3's selection bias: state, moved by moe_bias_update
            self.register_buffer("router_bias", torch.zeros(experts))
        else:
            self.router_bias = None
        self.dim, self.hidden, self.experts, self.top_k = dim, hidden, experts, top_k
        self.mlp, self.normalize = mlp, normalize
        self.router = nn.Linear(dim, experts, bias=logit_bias)
        self.up = nn.Parameter(torch.empty(experts, hidden, dim))
        if mlp not in ("gelu", "relu2"):  # the gated ones
            self.gate = nn.Parameter(torch.empty(experts, hidden, dim))
        self.down = nn.Parameter(torch.empty(experts, dim, hidden))
        self.expert_bias = expert_bias
        if expert_bias:  # gpt-oss: each expert's projections have biases
            self.up_bias = nn.Parameter(torch.empty(experts, hidden))
            if mlp not in ("gelu", "relu2"):
                self.gate_bias = nn.Parameter(torch.empty(experts, hidden))
            self.down_bias = nn.Parameter(torch.empty(experts, dim))
        self.shared_hidden, self.shared_gate = shared_hidden, shared_gate
        if shared_hidden is not None:  # one expert every token goes through
            self.shared = SwiGLU(dim, shared_hidden, bias=False) if mlp == "swiglu" else \
                nn.Sequential(nn.Linear(dim, shared_hidden, bias=False),
                              SquaredReLU() if mlp == "relu2" else nn.GELU(),
                              nn.Linear(shared_hidden, dim, bias=False))
            if shared_gate:
                self.gate_shared = nn.Linear(dim, 1, bias=False)
        self.out_bias = nn.Parameter(torch.empty(dim)) if output_bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each expert's matrices as ``nn.Linear``'s: uniform in ``±1/sqrt(fan_in)``; the
        output bias 0."""
        if getattr(self, "out_bias", None) is not None:
            nn.init.zeros_(self.out_bias)
        for w in (self.up, getattr(self, "gate", None), self.down):
            if w is not None:
                bound = 1 / math.sqrt(w.shape[-1])
                nn.init.uniform_(w, -bound, bound)
        if self.expert_bias:
            for b, fan_in in ((self.up_bias, self.dim), (getattr(self, "gate_bias", None),
                                                         self.dim), (self.down_bias, self.hidden)):
                if b is not None:
                    nn.init.uniform_(b, -fan_in ** -0.5, fan_in ** -0.5)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(logits (T, E), weights (T, top_k), experts (T, top_k))`` for tokens
        ``x`` ``(T, dim)``; the weights in ``x``'s dtype, the scores in float32 or wider.
        A router weight wider than ``x`` (a bf16 model's float32 router, as DeepSeek-V3
        keeps it) computes the logits in its dtype."""
        w, b = self.router.weight, self.router.bias
        work = torch.promote_types(x.dtype, w.dtype)
        logits = self.router(x) if w.dtype == x.dtype else nn.functional.linear(
            x.to(work), w.to(work), None if b is None else b.to(work))  # (T, E)
        weights, chosen = self.select(logits)
        return logits, weights.to(x.dtype), chosen

    def select(self, logits: Tensor, bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The routing of router ``logits`` ``(T, E)``: ``(weights, experts)``, each
        ``(T, top_k)``. ``bias`` (default the ``router_bias`` buffer) shifts the scores
        for the choice only, not the weights (DeepSeek-V3); with ``groups``, only the
        experts of the ``topk_groups`` groups whose two best scores sum highest
        (``group_score="max"``: whose best score is highest, DeepSeek-V2) compete."""
        scores = logits.to(torch.promote_types(logits.dtype, torch.float32))
        if self.scoring == "sparsemixer":
            return self._sparsemixer(scores)
        scores = scores.softmax(-1) if self.scoring == "softmax" else scores.sigmoid()
        bias = self.router_bias if bias is None else bias
        choice = scores if bias is None else scores + bias
        if self.groups is not None:
            per = choice.unflatten(-1, (self.groups, -1))  # (T, G, E / G)
            rank = per.topk(2, dim=-1).values.sum(-1) if self.group_score == "top2" else \
                per.amax(-1)  # (T, G)
            best = rank.topk(self.topk_groups, dim=-1).indices
            keep = torch.zeros_like(per[..., 0], dtype=torch.bool).scatter(-1, best, True)
            choice = per.masked_fill(~keep[..., None], float("-inf")).flatten(-2)
        chosen = choice.topk(self.top_k, dim=-1).indices  # (T, k)
        weights = scores.gather(-1, chosen)
        if self.normalize:
            total = weights.sum(-1, keepdim=True)
            weights = weights / (total + self.normalize_eps if self.normalize_eps else total)
        return weights * self.routed_scale, chosen

    def _sparsemixer(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        """SparseMixer's inference routing of ``logits`` ``(T, E)``: ``top_k`` rounds,
        each taking the best expert left and weighting it by its softmax among the experts
        left within ``2 * sparsemixer_eps`` of that best (relative)."""
        left = logits  # (T, E): -inf at the experts already taken
        weights, chosen = [], []
        for _ in range(self.top_k):
            best, pick = left.max(-1, keepdim=True)  # (T, 1)
            far = (best - logits) / logits.abs().clamp(min=best) > 2 * self.sparsemixer_eps
            gates = left.masked_fill(far, float("-inf")).softmax(-1)  # (T, E)
            weights.append(gates.gather(-1, pick))
            chosen.append(pick)
            left = left.scatter(-1, pick, float("-inf"))
        return torch.cat(weights, -1) * self.routed_scale, torch.cat(chosen, -1)

    def _expert(self, x: Tensor, e: int | None = None) -> Tensor:
        """Expert ``e`` on ``x`` ``(T, dim)``, or every expert (``e=None``) on ``x``
        ``(T, dim)`` or ``(E, T, dim)``: ``(..., T, dim) -> (..., T, dim)``."""
        def pick(w: Tensor | None, bias: bool = False) -> Tensor | None:
            if w is None or e is not None:
                return None if w is None else w[e]
            return w.unsqueeze(1) if bias else w  # biases (E, 1, n): over the tokens

        up, down, gate = pick(self.up), pick(self.down), pick(getattr(self, "gate", None))
        h = x @ up.transpose(-1, -2)  # (..., T, hidden)
        g = None if gate is None else x @ gate.transpose(-1, -2)
        if self.expert_bias:
            h = h + pick(self.up_bias, True)
            g = g + pick(self.gate_bias, True)
        if gate is None:
            h = nn.functional.relu(h).square() if self.mlp == "relu2" else nn.functional.gelu(h)
        elif self.mlp == "swiglu_clamp":  # gpt-oss: clamped, (up + 1) * g sigmoid(alpha g)
            g, h = g.clamp(max=self.swiglu_limit), h.clamp(-self.swiglu_limit, self.swiglu_limit)
            h = (h + 1) * g * torch.sigmoid(self.swiglu_alpha * g)
        else:
            h = nn.functional.silu(g) * h
        out = h @ down.transpose(-1, -2)  # (..., T, dim)
        return out + pick(self.down_bias, True) if self.expert_bias else out

    def forward(self, x: Tensor, return_router_logits: bool = False) -> Tensor | tuple:
        if x.shape[-1] != self.dim:
            raise ValueError(f"MoE: x must end in dim = {self.dim}, got shape {tuple(x.shape)}")
        shape = x.shape
        tokens = x.reshape(-1, self.dim)  # (T, dim)
        logits, weights, chosen = self.route(tokens)
        if self.capacity_factor is not None:
            out = self._capacity(tokens, weights, chosen)
        elif _batched_transform_active():
            out = self._dense(tokens, weights, chosen)
        else:
            out = self._sparse(tokens, weights, chosen)
        if self.shared_hidden is not None:
            shared = self.shared(tokens)  # (T, dim)
            if self.shared_gate:
                shared = torch.sigmoid(self.gate_shared(tokens)) * shared
            out = out + shared if self.shared_combine == "sum" else (out + shared) / 2
        if self.out_bias is not None:
            out = out + self.out_bias
        out = out.reshape(shape)
        return (out, logits.reshape(*shape[:-1], self.experts)) if return_router_logits else out

    def _dense(self, x: Tensor, weights: Tensor, chosen: Tensor) -> Tensor:
        """Every expert on every token, weighted by the routing (zero where unchosen)."""
        mix = torch.zeros(x.shape[0], self.experts, dtype=weights.dtype, device=x.device)
        mix = mix.scatter(-1, chosen, weights)  # (T, E)
        if self.weights_on == "input":  # each expert on its weighted copy of the tokens
            y = self._expert(mix.t()[..., None] * x)  # (E, T, dim)
            picked = torch.zeros_like(mix).scatter(-1, chosen, 1.0)  # (T, E): 0 where unchosen
            return torch.einsum("te,etd->td", picked, y)
        y = self._expert(x)  # (E, T, dim)
        return torch.einsum("te,etd->td", mix, y)

    def _capacity(self, x: Tensor, weights: Tensor, chosen: Tensor) -> Tensor:
        """Each expert on at most ``C`` of the tokens sent to it, in fixed-shape buffers
        ``(E, C, dim)``: the assignments beyond an expert's capacity add nothing."""
        t, k, e = x.shape[0], self.top_k, self.experts
        cap = max(1, math.ceil(self.capacity_factor * t * k / e))
        expert = chosen.t().reshape(-1)  # (k T,) slot-major: every first choice first
        token = torch.arange(t, device=x.device).repeat(k)  # (k T,)
        onehot = (expert[:, None] == torch.arange(e, device=x.device)).long()  # (k T, E)
        pos = ((onehot.cumsum(0) - 1) * onehot).sum(-1)  # (k T,) place in its expert's queue
        keep = pos < cap
        slot = torch.where(keep, expert * cap + pos, e * cap)  # dropped: a spare row
        w = (weights.t().reshape(-1) * keep).unsqueeze(-1)  # (k T, 1)
        into = x[token] * w if self.weights_on == "input" else x[token]  # (k T, dim)
        buf = x.new_zeros(e * cap + 1, self.dim).index_add(0, slot, into)  # (E C + 1, dim)
        y = self._expert(buf[:-1].view(e, cap, self.dim))  # (E, C, dim)
        y = torch.cat((y.reshape(e * cap, self.dim), y.new_zeros(1, self.dim)))
        if self.weights_on == "input":
            w = keep.unsqueeze(-1).to(y.dtype)  # weighted already; dropped: 0
        return x.new_zeros(x.shape).index_add(0, token, y[slot] * w)  # (T, dim)

    def _sparse(self, x: Tensor, weights: Tensor, chosen: Tensor) -> Tensor:
        """Tokens grouped by expert: each expert on its own tokens."""
        flat = chosen.reshape(-1)  # (T k,) expert of each (token, slot)
        order = flat.argsort(stable=True)
        token = order // self.top_k  # (T k,) the token of each sorted assignment
        counts = torch.bincount(flat, minlength=self.experts).tolist()
        w = weights.reshape(-1)[order, None]  # (T k, 1)
        into = x[token] * w if self.weights_on == "input" else x[token]
        groups = into.split(counts)  # E tensors (count_e, dim)
        outs = [self._expert(g, e) for e, g in enumerate(groups) if counts[e]]
        y = torch.cat(outs)  # (T k, dim)
        y = y if self.weights_on == "input" else y * w
        return x.new_zeros(x.shape).index_add(0, token, y)  # (T, dim)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, hidden={self.hidden}, experts={self.experts}, "
                f"top_k={self.top_k}, mlp={self.mlp!r}, normalize={self.normalize}, "
                f"shared_hidden={self.shared_hidden}, shared_gate={self.shared_gate}, "
                f"capacity_factor={self.capacity_factor}, scoring={self.scoring!r}, "
                f"weights_on={self.weights_on!r}")

    def expert_load(self, logits: Tensor, bias: Tensor | None = None) -> Tensor:
        """How many tokens each expert gets ``(E,)`` from router ``logits`` ``(..., E)``
        (``forward(..., return_router_logits=True)``'s), chosen with ``bias``."""
        chosen = self.select(logits.reshape(-1, self.experts), bias)[1]
        return torch.zeros(self.experts, device=logits.device).index_add(
            0, chosen.reshape(-1), torch.ones(chosen.numel(), device=logits.device))


def moe_bias_update(bias: Tensor, load: Tensor, rate: float = 1e-3) -> Tensor:
    """DeepSeek-V3's auxiliary-loss-free balancing: ``bias + rate * sign(mean(load) -
    load)``, a new ``(E,)`` tensor. Each step raises the bias of the experts that got
    fewer tokens than the mean and lowers the others', so the choice drifts toward
    balance without a gradient.

    Example::

        >>> import torch
        >>> from torchfn.models import moe_bias_update
        >>> moe_bias_update(torch.zeros(4), torch.tensor([10.0, 2.0, 4.0, 0.0]), rate=0.1)
        tensor([-0.1000,  0.1000,  0.0000,  0.1000])
    """
    if not isinstance(bias, Tensor) or not isinstance(load, Tensor) or bias.shape != load.shape \
            or bias.dim() != 1:
        raise ValueError(f"bias and load must be tensors (E,) of one shape, got "
                         f"{getattr(bias, 'shape', bias)} and {getattr(load, 'shape', load)}")
    return bias + rate * torch.sign(load.mean() - load).to(bias.dtype)

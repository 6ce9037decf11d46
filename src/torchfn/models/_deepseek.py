"""A Hugging Face checkpoint with DeepSeek's mixture of experts as a ``TransformerEncoder``,
its params and its router state, and back: DeepSeek-V2 / V3 (latent attention; Kimi K2 is
a ``deepseek_v3``), DeepSeek-V3.2 and GLM-5 (``glm_moe_dsa``: V3 with DeepSeek Sparse
Attention), GLM-4.7-Flash (``glm4_moe_lite``) and Youtu-LLM (``youtu``, dense) with
V3's attention, and GLM-4.5 / 4.6 (``glm4_moe``), Solar-Open (``solar_open``) and dots.llm1
(``dots1``) with grouped-query attention."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from torchfn.models._dequantize import dequantize_fp8
from torchfn.models._fit import check_fit, check_state_dict, join_pieces, param_shapes, read_state
from torchfn.models._llama import GLOBAL_NAMES, _ropes, partial_rotary
from torchfn.models._rotary_scaling import yarn_mscale
from torchfn.models._transformer import TransformerEncoder

__all__ = ["deepseek_from_hf", "deepseek_to_hf"]

_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "glm_moe_dsa", "glm4_moe",
          "glm4_moe_lite", "youtu", "solar_open", "dots1")
_GQA = ("glm4_moe", "solar_open", "dots1")  # q/k/v projections (joined into one qkv here),
# not latent attention
_INTERLEAVED = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa", "glm4_moe_lite", "youtu")
# (rope_interleave, default True); DeepSeek Sparse Attention: the lightning indexer's heads
# and HF's default count of them; GLM-5's indexer rotates interleaved pairs too, V3.2's not
_DSA = {"deepseek_v32": 64, "glm_moe_dsa": 32}
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
_NAMES = {  # a layer's HF names -> ours, but the experts
    "input_layernorm.weight": "ln1.weight",
    "post_attention_layernorm.weight": "ln2.weight",
    "self_attn.q_proj.weight": "attn.q.weight",
    "self_attn.q_a_proj.weight": "attn.q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn.q_norm.weight",
    "self_attn.q_b_proj.weight": "attn.q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn.kv_a.weight",
    "self_attn.kv_a_layernorm.weight": "attn.kv_norm.weight",
    "self_attn.kv_b_proj.weight": "attn.kv_b.weight",
    "self_attn.o_proj.weight": "attn.out.weight",
    "self_attn.o_proj.bias": "attn.out.bias",  # (dots1's, with attention_bias)
    "self_attn.indexer.wq_b.weight": "attn.indexer.q.weight",  # DSA's lightning indexer
    "self_attn.indexer.wk.weight": "attn.indexer.k.weight",
    "self_attn.indexer.k_norm.weight": "attn.indexer.k_norm.weight",
    "self_attn.indexer.k_norm.bias": "attn.indexer.k_norm.bias",
    "self_attn.indexer.weights_proj.weight": "attn.indexer.weights.weight",
    "mlp.gate_proj.weight": "mlp.gate.weight",  # a dense layer
    "mlp.up_proj.weight": "mlp.up.weight",
    "mlp.down_proj.weight": "mlp.down.weight",
    "mlp.gate.weight": "mlp.router.weight",
    **{f"mlp.shared_experts.{p}_proj.weight": f"mlp.shared.{p}.weight"
       for p in ("gate", "up", "down")},
}
_QKV = {f"self_attn.{p}_proj.{kind}": f"attn.qkv.{kind}" for kind in ("weight", "bias")
        for p in "qkv"}  # GLM: joined in the order q, k, v
_QK_NORMS = {"self_attn.q_norm.weight": "attn.q_norm.weight",
             "self_attn.k_norm.weight": "attn.k_norm.weight"}
_BIAS = "mlp.gate.e_score_correction_bias"  # V3's selection bias: our state
_HF_GLOBAL = {ours: hf for hf, ours in GLOBAL_NAMES.items()}
# a multi-token-prediction layer's own tensors (its block's are a layer's) -> ours, in mtp.{j}.
_MTP = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
        "eh_proj.weight": "proj.weight", "shared_head.norm.weight": "norm.weight"}
# ... and its copies of the embedding and the head, which torchfn shares with the model
_MTP_SHARED = {"embed_tokens.weight": "embed.weight", "shared_head.head.weight": "head.weight"}
_ROTATED = ("attn.q.weight", "attn.q_b.weight", "attn.kv_a.weight")  # rows with rotary parts
_INDEXER_ROTATED = ("attn.indexer.q.weight", "attn.indexer.k.weight",  # [rope | rest] rows
                    "attn.indexer.k_norm.weight", "attn.indexer.k_norm.bias")


def _config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``TransformerEncoder``'s arguments for a DeepSeek-V2 / V3 ``config``."""
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a dict (a DeepSeek config.json), got "
                        f"{type(config).__name__}")
    kind = config.get("model_type")
    if kind not in _TYPES:
        raise ValueError(f"config['model_type'] must be one of {_TYPES}, got {kind!r}")
    latent = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
    missing = [k for k in ("hidden_size", "num_attention_heads", "num_hidden_layers",
                           "vocab_size", *(() if kind in _GQA else latent),
                           *(() if kind == "solar_open" else ("intermediate_size",)))
               if config.get(k) is None]
    if missing:
        raise ValueError(f"config lacks {missing}: not a {kind} config")
    checks = [("hidden_act", "silu"), ("mlp_bias", False)]
    if kind not in _GQA:  # GLM's attention_bias is its q/k/v biases, which it has
        checks.append(("attention_bias", False))
    if kind == "dots1":  # (its windows, on the layers from max_window_layers on)
        checks.append(("use_sliding_window", False))
    for key, want in checks:
        if config.get(key, want) != want:
            raise ValueError(f"config[{key!r}] = {config[key]!r} is not supported here "
                             f"(needs {want!r})")
    depth, dim, heads = config["num_hidden_layers"], config["hidden_size"], \
        config["num_attention_heads"]
    rotary = _ropes(config, ["full_attention"] * depth)
    kwargs: dict[str, Any] = dict(
        dim=dim, heads=heads, depth=depth,
        vocab_size=config["vocab_size"], out_dim=config["vocab_size"], causal=True,
        max_len=config.get("max_position_embeddings", 4096), position_embedding="rotary",
        norm="rms", mlp="swiglu", bias=False,
        mlp_hidden=config.get("intermediate_size") or config["moe_intermediate_size"],
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(config.get("tie_word_embeddings", kind == "youtu")), **rotary)
    if kind in _GQA:  # Llama's attention, q/k/v biases and q/k norms as the config says
        head_dim = config.get("head_dim") or dim // heads
        partial = partial_rotary(config)
        bias = bool(config.get("attention_bias", False))
        kwargs.update(kv_heads=config.get("num_key_value_heads") or heads, head_dim=head_dim,
                      qkv_bias=bias, out_bias=bias and kind == "dots1",  # dots1: o's too
                      qk_norm=kind == "dots1" or bool(config.get("use_qk_norm", False)),
                      rotary_dim=None if partial == 1 else int(head_dim * partial))
    else:
        nope, rope = config["qk_nope_head_dim"], config["qk_rope_head_dim"]
        scale = (nope + rope) ** -0.5
        scaling = rotary["rotary_scaling"]
        if scaling and scaling.get("mscale_all_dim"):  # YaRN's temperature, on the scores
            scale *= yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
        kwargs.update(attn_scale=scale, latent_attention=dict(
            kv_rank=config["kv_lora_rank"], rope_dim=rope, nope_dim=nope,
            v_dim=config["v_head_dim"], q_rank=config.get("q_lora_rank")))
        if kind in _DSA:
            kwargs["latent_attention"]["indexer"] = _indexer(config, kind, depth)
    experts = config.get("n_routed_experts")
    first = config.get("first_k_dense_replace") or 0
    sparse = [experts is not None and i >= first for i in range(depth)]
    if kind == "solar_open":  # every layer a mixture
        sparse = [experts is not None] * depth
    elif config.get("mlp_layer_types") is not None:  # GLM-4.7-Flash: "dense" / "sparse"
        types = list(config["mlp_layer_types"])
        if len(types) != depth or not set(types) <= {"dense", "sparse"}:
            raise ValueError(f"config['mlp_layer_types'] must list 'dense' or 'sparse' for "
                             f"each of {depth} layers, got {types!r}")
        sparse = [experts is not None and t == "sparse" for t in types]
    if any(sparse):
        kwargs.update(experts=experts, top_k=config.get("num_experts_per_tok", 8),
                      expert_hidden=config["moe_intermediate_size"],
                      moe_options=_routing(config, kind),
                      layer_experts=None if all(sparse) else sparse)
    return kwargs


def _indexer(config: Mapping[str, Any], kind: str, depth: int) -> dict[str, int]:
    """``LatentAttention``'s ``indexer``: DeepSeek Sparse Attention's lightning indexer
    (``index_n_heads``, ``index_head_dim``, ``index_topk``) in every layer."""
    types = config.get("indexer_types")
    if types is not None and any(t != "full" for t in types):
        raise ValueError(f"config['indexer_types'] = {list(types)!r} is not supported here "
                         f"(needs 'full' in each of {depth} layers: layers that reuse an "
                         f"earlier layer's choice of keys are not built here)")
    return dict(heads=config.get("index_n_heads", _DSA[kind]),
                head_dim=config.get("index_head_dim", 128),
                topk=config.get("index_topk", 2048))


def _routing(config: Mapping[str, Any], kind: str) -> dict[str, Any]:
    """``MoE``'s options: V3 scores by sigmoid, picks among the ``topk_group`` groups
    whose two best (biased) scores sum highest, renormalises (``norm_topk_prob``); V2
    scores by softmax, groups only with ``topk_method="group_limited_greedy"`` (ranked by
    their best score), no renormalisation. Both scale the weights by
    ``routed_scaling_factor`` and add ``n_shared_experts`` experts' worth of shared MLP."""
    options: dict[str, Any] = dict(routed_scale=float(config.get("routed_scaling_factor", 1.0)))
    shared = config.get("n_shared_experts")
    if shared:
        options["shared_hidden"] = config["moe_intermediate_size"] * shared
    if kind != "deepseek_v2":  # V3's router, which GLM-4.5 shares
        options.update(scoring="sigmoid", router_bias=True,
                       normalize=bool(config.get("norm_topk_prob", True)),
                       groups=config.get("n_group") or 1,
                       topk_groups=config.get("topk_group") or 1)
        return options
    method = config.get("topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"config['topk_method'] = {method!r} is not supported for "
                         f"deepseek_v2 (needs 'greedy' or 'group_limited_greedy')")
    if config.get("norm_topk_prob"):
        raise ValueError("config['norm_topk_prob'] = True is not supported for deepseek_v2 "
                         "(transformers' DeepSeek-V2 does not renormalise; DeepSeek's own "
                         "code does: the two disagree)")
    options.update(normalize=False)
    if method == "group_limited_greedy":
        options.update(groups=config["n_group"], topk_groups=config["topk_group"],
                       group_score="max")
    return options


def _interleaved(config: Mapping[str, Any]) -> bool:
    """Whether the checkpoint pairs its rotary features as ``(x0, x1), (x2, x3), ...``
    (DeepSeek's own layout; V2 always, V3 unless ``rope_interleave=False``)."""
    kind = config.get("model_type")
    return kind == "deepseek_v2" or (kind in _INTERLEAVED
                                     and bool(config.get("rope_interleave", True)))


def _rotary_rows(config: Mapping[str, Any], ours: str, rows: int) -> Tensor:
    """For a matrix with rotary output rows, the row order that takes the checkpoint's
    interleaved pairs ``(x0, x1), (x2, x3), ...`` to the half-split ``(x0, x2, ..., x1,
    x3, ...)`` that :func:`apply_rotary` rotates: both give the same scores."""
    rope, nope = config["qk_rope_head_dim"], config["qk_nope_head_dim"]
    pairs = torch.cat((torch.arange(0, rope, 2), torch.arange(1, rope, 2)))  # (dr,)
    order = torch.arange(rows)
    if ours == "attn.kv_a.weight":  # [latent | rope key]
        order[-rope:] = rows - rope + pairs
    else:  # per head [nope | rope]
        per = nope + rope
        for h in range(rows // per):
            order[h * per + nope:(h + 1) * per] = h * per + nope + pairs
    return order


def _indexer_rows(config: Mapping[str, Any], ours: str, rows: int) -> Tensor:
    """For GLM-5's indexer matrices (and its key norm), the order that takes each head's
    interleaved rotary pairs (its first ``qk_rope_head_dim`` rows) to the half-split
    layout; the other rows stay."""
    rope = config["qk_rope_head_dim"]
    per = config.get("index_head_dim", 128)
    pairs = torch.cat((torch.arange(0, rope, 2), torch.arange(1, rope, 2)))  # (dr,)
    order = torch.arange(rows)
    for h in range(rows // per):
        order[h * per:h * per + rope] = h * per + pairs
    return order


def _rows(config: Mapping[str, Any], ours: str, rows: int) -> Tensor | None:
    """The order that takes a checkpoint matrix's rows to ours, or None: as they are."""
    if ours in _ROTATED and _interleaved(config):
        return _rotary_rows(config, ours, rows)
    if ours in _INDEXER_ROTATED and config.get("model_type") == "glm_moe_dsa":
        return _indexer_rows(config, ours, rows)
    return None


def deepseek_from_hf(config: Mapping[str, Any], state_dict: Mapping[str, Tensor] | None = None,
                     **overrides: Any,
                     ) -> tuple[TransformerEncoder, dict[str, Tensor] | None,
                                dict[str, Tensor] | None]:
    """The ``TransformerEncoder`` of a Hugging Face DeepSeek-V2 or V3 ``config``
    (``model_type`` ``"deepseek_v2"`` / ``"deepseek_v3"``; Kimi K2 is the latter) or of a
    GLM-4.5 / 4.6 one (``"glm4_moe"``), and the params and state of its ``state_dict``
    under the encoder's names.

    GLM-4.5 has DeepSeek-V3's mixture (and router state) behind Llama's grouped-query
    attention: q/k/v biases (``attention_bias``), q/k norms (``use_qk_norm``) and a
    rotated fraction of each head (``partial_rotary_factor``); its q, k and v become one
    ``qkv`` matrix. Solar-Open (``"solar_open"``) is the same with a mixture in every
    layer; dots.llm1 (``"dots1"``) with q/k norms always and ``attention_bias`` on the
    output too. GLM-4.7-Flash (``"glm4_moe_lite"``) is DeepSeek-V3 with its dense and
    sparse layers listed (``mlp_layer_types``), Youtu-LLM (``"youtu"``) V3's attention with
    a dense MLP in every layer. DeepSeek-V3.2 (``"deepseek_v32"``) and GLM-5
    (``"glm_moe_dsa"``) are V3 with DeepSeek Sparse Attention: a lightning indexer
    (``index_n_heads``, ``index_head_dim``, ``index_topk``; ``LatentAttention(indexer=)``)
    picks each query's keys; GLM-5's indexer rows are permuted from interleaved pairs as
    the attention's are, and its layers that share an earlier layer's choice
    (``indexer_types`` ``"shared"``) are refused. The rest of this paragraph is
    DeepSeek's.

    Attention is :class:`LatentAttention` (``kv_lora_rank``, ``q_lora_rank``,
    ``qk_rope_head_dim``, ``qk_nope_head_dim``, ``v_head_dim``); its rotary rows are
    permuted from DeepSeek's interleaved pairs to the half-split layout (V3 with
    ``rope_interleave=False`` is kept as is), and YaRN's ``mscale_all_dim`` multiplies the
    scores' scale by its square, as DeepSeek does. The first ``first_k_dense_replace``
    layers have a dense SwiGLU MLP, the others a :class:`MoE` of ``n_routed_experts``
    with ``n_shared_experts`` shared: V3's sigmoid scores, group-limited choice and
    renormalised weights, V2's softmax (``topk_method`` ``"greedy"`` or
    ``"group_limited_greedy"``), both times ``routed_scaling_factor``. V3's
    ``e_score_correction_bias`` is router *state* (``blocks.i.mlp.router_bias``, for
    :func:`moe_bias_update`), returned apart from the params: pass it as
    ``Model.apply``'s ``state`` (to decode, bind it:
    ``generate(functools.partial(model.apply, state=state), params, prompt, n)``).
    Multi-token-prediction layers past
    ``num_hidden_layers`` (DeepSeek-V3's layer 61) are skipped, or with ``mtp=D`` the
    first ``D`` read as the model's :class:`MultiTokenPrediction` depths (``mtp.{j}.*``;
    their copies of the embedding and head must be the model's, which they share;
    tested against transformers' own decoder layer run as DeepSeek's MTP, and written
    back by :func:`deepseek_to_hf`). An FP8 checkpoint
    (DeepSeek-V3's: e4m3 weights, each 128 x 128 block with its ``weight_scale_inv``) is
    dequantized to bfloat16 (:func:`dequantize_fp8`). Tested against
    ``transformers`` 5 on logits, cached decoding and the round trip.

    Args:
        config: the checkpoint's ``config.json`` as a dict.
        state_dict: its tensors under Hugging Face's names, or None for the module alone.
        overrides: other ``TransformerEncoder`` arguments (``attend``, ``remat``, ...).

    Returns:
        ``(module, params, state)``; ``params`` and ``state`` are None without a
        ``state_dict``, ``state`` is ``{}`` for V2.

    Example::

        >>> import torch
        >>> import torchfn
        >>> from torchfn.models import deepseek_from_hf
        >>> config = {"model_type": "deepseek_v3", "hidden_size": 32, "num_attention_heads": 4,
        ...           "num_hidden_layers": 2, "intermediate_size": 48, "vocab_size": 10,
        ...           "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8,
        ...           "qk_nope_head_dim": 8, "v_head_dim": 8, "n_routed_experts": 4,
        ...           "num_experts_per_tok": 2, "moe_intermediate_size": 8,
        ...           "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 2,
        ...           "topk_group": 1}
        >>> module, _, _ = deepseek_from_hf(config)
        >>> model = torchfn.Model(module)
        >>> params, state = model.init(torchfn.random.key(0)), model.init_state()
        >>> sorted(state)
        ['blocks.1.mlp.router_bias']
        >>> model.apply(params, torch.tensor([[1, 2, 3]]), state=state).shape
        torch.Size([1, 3, 10])
    """
    kwargs = _config(config)
    kwargs.update(overrides)
    check_state_dict(state_dict)
    module = TransformerEncoder(**kwargs)
    if state_dict is None:
        return module, None, None
    if any(name.endswith("_scale_inv") for name in state_dict):
        state_dict = dequantize_fp8(state_dict, config)
    depth, kind = kwargs["depth"], config["model_type"]
    params: dict[str, Tensor] = {}
    state: dict[str, Tensor] = {}
    stacks: dict[str, dict[int, Tensor]] = {}
    qkv: dict[str, dict[str, Tensor]] = {}  # GLM: our joined name -> q, k, v
    shared: dict[str, tuple[str, Tensor]] = {}  # the MTP layers' embedding and head copies
    gqa, mtp = kind in _GQA, kwargs.get("mtp", 0)

    def read_layer(i: str, rest: str, tensor: Tensor) -> bool:
        j = int(i) - depth
        if 0 <= j < mtp:  # a multi-token-prediction layer, read with mtp=
            if rest in _MTP:
                params[f"mtp.{j}.{_MTP[rest]}"] = tensor
            elif rest in _MTP_SHARED:
                shared[f"model.layers.{i}.{rest}"] = (_MTP_SHARED[rest], tensor)
            else:
                return read_block(f"mtp.{j}.block.", rest, tensor)
            return True
        if j >= 0:  # a multi-token-prediction layer, if any: not used here (mtp=0)
            return bool(config.get("num_nextn_predict_layers")) or kind == "glm4_moe_lite"
        return read_block(f"blocks.{i}.", rest, tensor)

    def read_block(at: str, rest: str, tensor: Tensor) -> bool:
        expert = _EXPERT.fullmatch(rest)
        if gqa and rest in _QKV:
            qkv.setdefault(at + _QKV[rest], {})[rest[10]] = tensor
        elif gqa and rest in _QK_NORMS:
            params[at + _QK_NORMS[rest]] = tensor
        elif rest in _NAMES:
            ours = _NAMES[rest]
            order = _rows(config, ours, tensor.shape[0])
            params[at + ours] = tensor if order is None else tensor[order]
        elif rest == _BIAS and kind != "deepseek_v2":
            state[at + "mlp.router_bias"] = tensor
        elif expert:  # expert j's matrix -> row j of the stacked one
            stacks.setdefault(f"{at}mlp.{expert[2]}", {})[int(expert[1])] = tensor
        else:
            return False
        return True

    read_state(state_dict.items(), kind, params, globals_=GLOBAL_NAMES,
               tied=kwargs["tie_embeddings"], read_layer=read_layer)
    for name, pieces in stacks.items():
        if sorted(pieces) != list(range(kwargs["experts"])):
            raise ValueError(f"state_dict holds experts {sorted(pieces)[:8]} for {name}, "
                             f"not 0..{kwargs['experts'] - 1}")
        params[name] = torch.stack([pieces[j] for j in range(len(pieces))])  # (E, ...)
    join_pieces(params, qkv)
    for name, (ours, tensor) in shared.items():  # the model's own, or the model is not ours
        ours = "embed.weight" if ours not in params else ours  # (tied: the head is it)
        if ours in params and not torch.equal(tensor, params[ours]):
            raise ValueError(f"state_dict's {name} is not the model's {ours}: torchfn's "
                             f"multi-token prediction shares the model's")
    _check(module, params, state)
    return module, params, state


def _check(module: TransformerEncoder, params: Mapping[str, Tensor],
           state: Mapping[str, Tensor]) -> None:
    """Every param and state tensor of ``module``, no other, each of its shape."""
    check_fit(param_shapes(module), params, "state_dict (params)")
    check_fit({n: tuple(b.shape) for n, b in module.named_buffers()
               if n.endswith("router_bias")}, state, "state_dict (state)")


def deepseek_to_hf(config: Mapping[str, Any], params: Mapping[str, Tensor],
                   state: Mapping[str, Tensor] | None = None) -> dict[str, Tensor]:
    """``params`` (and, for V3, the routers' ``state``) of the model
    ``deepseek_from_hf(config)`` builds, under a Hugging Face checkpoint's names: the
    rotary rows back in DeepSeek's interleaved order, the stacked experts one matrix each
    (copies), ``router_bias`` as ``e_score_correction_bias``. The inverse of
    :func:`deepseek_from_hf`: the round trip gives the checkpoint back bit for bit.

    Example::

        >>> import torchfn
        >>> from torchfn.models import deepseek_from_hf, deepseek_to_hf
        >>> config = {"model_type": "deepseek_v2", "hidden_size": 16, "num_attention_heads": 2,
        ...           "num_hidden_layers": 1, "intermediate_size": 24, "vocab_size": 10,
        ...           "kv_lora_rank": 8, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4,
        ...           "v_head_dim": 4}
        >>> model = torchfn.Model(deepseek_from_hf(config)[0])
        >>> sd = deepseek_to_hf(config, model.init(torchfn.random.key(0)))
        >>> sd["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].shape  # [latent | rope]
        torch.Size([12, 16])
    """
    if not isinstance(params, Mapping):
        raise TypeError(f"params must be a dict of tensors, got {type(params).__name__}")
    mtp = len({n.split(".")[1] for n in params if n.startswith("mtp.")})  # its depths
    module = TransformerEncoder(**_config(config), mtp=mtp)
    state = {} if state is None else state
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a dict of tensors or None, got {type(state).__name__}")
    _check(module, params, state)
    kwargs = _config(config)
    hf_name = {ours: hf for hf, ours in _NAMES.items()}
    if config["model_type"] in _GQA:
        hf_name.update({ours: hf for hf, ours in _QK_NORMS.items()})
        hd = kwargs["head_dim"]
        sizes = [kwargs["heads"] * hd, kwargs["kv_heads"] * hd, kwargs["kv_heads"] * hd]
    out: dict[str, Tensor] = {}
    back = {ours: hf for hf, ours in _MTP.items()}
    for name, t in {**params, **state}.items():
        if name in _HF_GLOBAL:
            out[_HF_GLOBAL[name]] = t
            continue
        i, rest = name.split(".", 2)[1:]
        if name.startswith("mtp."):  # depth j: the layer after the model's
            i = str(kwargs["depth"] + int(i))
            if rest in back:
                out[f"model.layers.{i}.{back[rest]}"] = t
                continue
            rest = rest.removeprefix("block.")
        at = f"model.layers.{i}."
        if rest == "mlp.router_bias":
            out[at + _BIAS] = t
        elif rest in ("attn.qkv.weight", "attn.qkv.bias"):  # GLM: q, k, v apart
            for p, part in zip("qkv", t.split(sizes)):
                out[f"{at}self_attn.{p}_proj.{rest.rsplit('.', 1)[1]}"] = part.clone()
        elif rest in ("mlp.gate", "mlp.up", "mlp.down"):  # stacked experts (E, ...)
            for j, part in enumerate(t.unbind(0)):
                out[f"{at}mlp.experts.{j}.{rest[4:]}_proj.weight"] = part.clone()
        else:
            order = _rows(config, rest, t.shape[0])
            out[at + hf_name[rest]] = t if order is None else t[torch.argsort(order)]
    for j in range(mtp):  # the MTP layers' copies of the embedding and the head
        at = f"model.layers.{kwargs['depth'] + j}."
        out[at + "embed_tokens.weight"] = params["embed.weight"].clone()
        out[at + "shared_head.head.weight"] = params.get("head.weight",
                                                         params["embed.weight"]).clone()
    return out


"""sCM's continuous-time consistency loss (Lu & Song 2024, "Simplifying, stabilizing and
scaling continuous-time consistency models"): consistency training (sCT) or
distillation (sCD) on the TrigFlow path, with the time derivative of the network from one
forward-mode product (``torch.func.jvp``).

On ``x_t = cos(t) x0 + sin(t) z`` (``z ~ N(0, sd^2)``) the consistency function is
``f(x, t) = cos(t) x - sin(t) sd F(x / sd, t)``. Its total derivative along the
probability-flow ODE must vanish; the loss moves ``F`` against

    g = -cos^2(t) (sd F^- - dx/dt) - r cos(t) sin(t) (x_t + sd dF^-/dt)  (= cos(t) df/dt at r = 1)

where ``F^-`` is the network with its gradient stopped and ``dF^-/dt`` the jvp of
``F^-(x_t / sd, t)`` along ``(dx_t/dt / sd, 1)`` (taken with both tangents times
``cos(t) sin(t)``, as the paper, to keep it finite near ``pi/2``). ``dx/dt`` is the
conditional velocity ``cos(t) z - sin(t) x0`` (sCT) or a TrigFlow teacher's ``sd
F_teacher(x_t / sd, t)`` (sCD).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from torchfn import random
from torchfn.losses._flow_matching import _check_x0

__all__ = ["scm_loss"]


def _positive(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a float > 0, got {value!r}")
    return float(value)


def _tangent(net_fn: Callable[[Tensor, Tensor], Tensor], x_t: Tensor, t: Tensor, dxdt: Tensor,
             sigma_data: float, warmup: float) -> tuple[Tensor, Tensor]:
    """``(F(x_t / sd, t), g)``: the network's output (differentiable) and the
    un-normalised target direction ``g`` (detached). ``t: (B,)``."""
    view = (-1,) + (1,) * (x_t.dim() - 1)
    cos, sin = t.cos().view(view), t.sin().view(view)
    cs = cos * sin  # (B, 1, ...)
    out, cs_dfdt = torch.func.jvp(net_fn, (x_t / sigma_data, t),
                                  (cs * dxdt / sigma_data, cs.reshape(t.shape)))
    f_minus, cs_dfdt = out.detach(), cs_dfdt.detach()
    g = -cos * cos * (sigma_data * f_minus - dxdt) - warmup * (cs * x_t + sigma_data * cs_dfdt)
    return out, g


def scm_loss(
    net_fn: Callable[[Tensor, Tensor], Tensor],
    x0: Tensor,
    key: Tensor,
    *,
    sigma_data: float = 0.5,
    p_mean: float = -1.0,
    p_std: float = 1.4,
    time_scale: float = 1.0,
    tangent_warmup: float = 1.0,
    tangent_c: float = 0.1,
    teacher_fn: Callable[[Tensor, Tensor], Tensor] | None = None,
    weight_fn: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """sCM's loss, ``mean_b [e^{w(t)} mean_d (F - sg(F + g / (|g| + c)))^2 - w(t)]``.

    Per example ``t = arctan(e^tau / sd)``, ``tau ~ N(p_mean, p_std)``, and ``g`` as in
    the module's notes; ``|g|`` is each example's norm over its coordinates (tangent
    normalisation, ``c = tangent_c``). The network runs once, inside the ``jvp``: its
    primal output is the prediction ``F`` (differentiable), its detached copy is
    ``F^-``. With the exact consistency network and the exact teacher (sCD), ``g = 0``
    everywhere and so is the loss's gradient (tested on Gaussian data).

    The network's forward-mode derivative is taken: every op in it must support
    ``jvp`` (``torchfn.kernels.attention`` does, and ``grad`` of this loss through it is
    tested equal to materialised attention; SDPA and FlashAttention have no forward
    mode, which sCM had to write a kernel for).

    Args:
        net_fn: the TrigFlow network ``F(x_in, c_noise) -> (B, ...)``, called with ``x_in =
            x_t / sd`` and ``c_noise = time_scale t``; sample it with
            :func:`torchfn.transforms.diffusion.trigflow_consistency`.
        x0: ``(B, ...)`` data.
        key: PRNG key for the times and the noise.
        sigma_data: the data's standard deviation (and the noise's).
        p_mean, p_std: the log-normal proposal of ``tan(t) sd`` (the paper's CIFAR-10
            values; ImageNet used -0.8 and 1.6).
        time_scale: ``c_noise = time_scale t``. Keep it small: ``dF/dt`` grows with it,
            and sCM found EDM-style large scales unstable (it uses 1). On
            ``examples/flow_matching_2d.py`` a scale of 1000 / (pi/2) gave one-step
            samples 1000x farther from the data than 10 did.
        tangent_warmup: ``r`` in ``[0, 1]``, the paper's ``min(1, step / H)``.
        tangent_c: the normalisation's floor (0.1).
        teacher_fn: sCD's pretrained TrigFlow diffusion network ``F_teacher(x_in,
            c_noise)`` (its velocity is ``sd F_teacher``); None: sCT.
        weight_fn: the adaptive weighting's log-variance ``w(t) -> (B,)``
            (trainable, differentiable), or None for ``w = 0``.

    Returns:
        The scalar loss, in ``x0``'s dtype.

    Example::

        >>> import torch
        >>> from torchfn import random
        >>> x0 = torch.full((16, 3), 0.7, dtype=torch.float64)    # data at one point
        >>> def exact(x_in, t):          # cos(t) x - sin(t) sd F = 0.7 at every (x, t)
        ...     v = t.view(-1, 1)
        ...     return (v.cos() * 0.5 * x_in - 0.7) / (0.5 * v.sin())
        >>> float(scm_loss(exact, x0, random.key(0))) < 1e-6
        True
    """
    if not callable(net_fn):
        raise TypeError(f"net_fn must be callable, got {type(net_fn).__name__}")
    _check_x0(x0)
    sd = _positive("sigma_data", sigma_data)
    for name, value in (("p_std", p_std), ("time_scale", time_scale),
                        ("tangent_c", tangent_c)):
        _positive(name, value)
    if isinstance(tangent_warmup, bool) or not isinstance(tangent_warmup, (int, float)) or \
            not 0 <= tangent_warmup <= 1:
        raise ValueError(f"tangent_warmup must lie in [0, 1], got {tangent_warmup!r}")
    for name, fn in (("teacher_fn", teacher_fn), ("weight_fn", weight_fn)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be callable or None, got {type(fn).__name__}")

    B, dtype, device = x0.shape[0], x0.dtype, x0.device
    k_t, k_z = random.split(key)
    tau = p_mean + p_std * random.normal(k_t, (B,), dtype=dtype)
    t = torch.atan(tau.exp() / sd).to(device)  # (B,) in (0, pi/2)
    view = (B,) + (1,) * (x0.dim() - 1)
    z = sd * random.normal(k_z, tuple(x0.shape), dtype=dtype).to(device)  # (B, ...)
    cos, sin = t.cos().view(view), t.sin().view(view)
    x_t = cos * x0 + sin * z

    def net(x_in: Tensor, tt: Tensor, fn=net_fn, name="net_fn") -> Tensor:
        out = fn(x_in, tt * time_scale)
        if not isinstance(out, Tensor) or out.shape != x0.shape:
            got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            raise ValueError(f"{name}(x_in, c_noise) must return x0's shape "
                             f"{tuple(x0.shape)}, got {got}")
        return out

    if teacher_fn is None:
        dxdt = cos * z - sin * x0  # the conditional velocity
    else:
        dxdt = (sd * net(x_t / sd, t, teacher_fn, "teacher_fn")).detach()
    out, g = _tangent(net, x_t, t, dxdt, sd, float(tangent_warmup))
    norm = g.reshape(B, -1).norm(dim=1).view(view)  # (B, 1, ...)
    g = g / (norm + tangent_c)
    err = (out - out.detach() - g).pow(2).reshape(B, -1).mean(dim=1)  # (B,)
    if weight_fn is not None:
        w = weight_fn(t)
        if not isinstance(w, Tensor) or w.shape != (B,):
            got = tuple(w.shape) if isinstance(w, Tensor) else type(w).__name__
            raise ValueError(f"weight_fn(t) must return shape (B,) = ({B},), got {got}")
        err = w.exp() * err - w
    return err.mean()

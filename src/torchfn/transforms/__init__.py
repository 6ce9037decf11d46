"""Transforms: per-sample gradients, DP-SGD and its accountant, samplers (Langevin, HMC,
NUTS and their diagnostics), diffusion, returns and advantages, curvature (Hessian products,
spectra, K-FAC and EK-FAC, the Laplace approximation, influence functions, K-FAC as an
optimizer) and solvers (ODEs, SDEs, fixed points, least squares, conjugate gradients)."""

from torchfn.transforms import diffusion
from torchfn.transforms._accountant import (
    DEFAULT_ORDERS,
    compute_rdp,
    noise_multiplier_for,
    rdp_epsilon,
    rdp_to_epsilon,
)
from torchfn.transforms._adversarial import adversarial_loss, fgsm, pgd
from torchfn.transforms._cg import cg
from torchfn.transforms._curvature import (
    gauss_newton_vp,
    hessian,
    hessian_operator,
    hvp,
    jacobian,
    ntk,
)
from torchfn.transforms._diagnostics import (
    bfmi,
    effective_sample_size,
    print_summary,
    rhat,
    summary,
)
from torchfn.transforms._divergence import divergence
from torchfn.transforms._dp_sgd import (
    DPSGDState,
    DPStep,
    clip_and_sum,
    dp_noise,
    dp_sgd,
    make_dp_step,
    pad_batch,
    poisson_sample,
)
from torchfn.transforms._ekfac import EKFACFactor, ekfac
from torchfn.transforms._ensemble import (
    ensemble_apply,
    ensemble_init,
    ensemble_size,
    ensemble_step,
)
from torchfn.transforms._federated import fedavg, federated_round, local_train
from torchfn.transforms._fixed_point import fixed_point
from torchfn.transforms._ghost import GhostClipResult, ghost_clip_grads, ghost_norms
from torchfn.transforms._hmc import HMCInfo, hmc, hmc_step
from torchfn.transforms._influence import influence
from torchfn.transforms._kfac import KronFactor, kfac
from torchfn.transforms._langevin import langevin
from torchfn.transforms._laplace import (
    KronPrecision,
    LaplacePosterior,
    laplace,
    laplace_predict,
    laplace_sample,
)
from torchfn.transforms._laplace_evidence import laplace_log_marginal, laplace_optimize_prior
from torchfn.transforms._least_squares import LeastSquaresInfo, least_squares
from torchfn.transforms._natural_gradient import KFACState, kfac_curvature, kfac_precondition
from torchfn.transforms._nuts import NUTSInfo, nuts, nuts_step
from torchfn.transforms._odeint import odeint
from torchfn.transforms._per_sample import (
    clip_coefficients,
    per_sample_grad_norms,
    per_sample_grads,
)
from torchfn.transforms._rendering import Rendered, stratified_depths, volume_render
from torchfn.transforms._replay import ReplayBuffer, replay_init, replay_push, replay_sample
from torchfn.transforms._returns import discounted_returns, gae, vtrace
from torchfn.transforms._sam import sam
from torchfn.transforms._sdeint import sdeint
from torchfn.transforms._spectrum import (
    eigsh,
    hutchinson_trace,
    spectral_density,
    spectral_quadrature,
)

__all__ = [
    # per-sample gradients (torchfn.transforms._per_sample)
    "per_sample_grads",
    "per_sample_grad_norms",
    "clip_coefficients",
    # DP-SGD (torchfn.transforms._dp_sgd)
    "dp_sgd",
    "dp_noise",
    "DPSGDState",
    "clip_and_sum",
    "make_dp_step",
    "DPStep",
    "poisson_sample",
    "pad_batch",
    # ghost clipping (torchfn.transforms._ghost)
    "ghost_norms",
    "ghost_clip_grads",
    "GhostClipResult",
    # RDP accountant (torchfn.transforms._accountant)
    "rdp_epsilon",
    "noise_multiplier_for",
    "compute_rdp",
    "rdp_to_epsilon",
    "DEFAULT_ORDERS",
    # EBM sampling (torchfn.transforms._langevin, _replay); diffusion subpackage
    "langevin",
    "hmc",
    "hmc_step",
    "HMCInfo",
    "nuts",
    "nuts_step",
    "NUTSInfo",
    "rhat",
    "effective_sample_size",
    "summary",
    "print_summary",
    "bfmi",
    "laplace",
    "kfac",
    "KronFactor",
    "ekfac",
    "EKFACFactor",
    "kfac_curvature",
    "kfac_precondition",
    "KFACState",
    "influence",
    "KronPrecision",
    "laplace_predict",
    "laplace_log_marginal",
    "laplace_sample",
    "laplace_optimize_prior",
    "LaplacePosterior",
    "ReplayBuffer",
    "replay_init",
    "replay_sample",
    "replay_push",
    "diffusion",
    # fixed points with implicit derivatives (torchfn.transforms._fixed_point)
    "fixed_point",
    # nonlinear least squares, Levenberg-Marquardt (torchfn.transforms._least_squares)
    "least_squares",
    "LeastSquaresInfo",
    # divergence, exact or Hutchinson (torchfn.transforms._divergence)
    "divergence",
    # ODEs with adjoint derivatives, SDEs on keyed paths (_odeint, _sdeint)
    "odeint",
    "sdeint",
    # adversarial, curvature, ensembles, federated (_adversarial, _curvature, ...)
    "fgsm",
    "pgd",
    "adversarial_loss",
    "jacobian",
    "hessian",
    "hvp",
    "hessian_operator",
    "cg",
    "gauss_newton_vp",
    "ntk",
    # spectra of symmetric operators (_spectrum)
    "eigsh",
    "hutchinson_trace",
    "spectral_quadrature",
    "spectral_density",
    "sam",
    "ensemble_init",
    "ensemble_apply",
    "ensemble_step",
    "ensemble_size",
    "fedavg",
    "local_train",
    "federated_round",
    # reinforcement learning's returns and advantages (torchfn.transforms._returns)
    "discounted_returns",
    "gae",
    "vtrace",
    # NeRF volume rendering (torchfn.transforms._rendering)
    "volume_render",
    "Rendered",
    "stratified_depths",
]

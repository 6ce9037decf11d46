"""Diffusion and flow models: discrete-time DDPM / DDIM / DPM-Solver++ (schedules, the
forward process, samplers), rectified flow (``flow_sample``), EDM (``edm_sample``) and
the VP probability flow, and consistency models (``consistency_sample``,
``trigflow_sample``, ``lcm_sample``, ``tcd_sample``).

    >>> import torch
    >>> from torchfn import random
    >>> from torchfn.transforms import diffusion
    >>> s = diffusion.cosine_schedule(1000)                    # float64 coefficients
    >>> k1, k2, k3 = random.split(random.key(1), 3)
    >>> x0, noise = random.normal(k1, (8, 2)), random.normal(k2, (8, 2))
    >>> t = random.randint(k3, (8,), 0, 1000)
    >>> x_t = diffusion.q_sample(s, x0, t, noise)              # x0: (B, ...), t: (B,) int64
    >>> eps_fn = lambda x_t, t: torch.zeros_like(x_t)          # a trained model's noise
    >>> x = diffusion.ddim_sample(eps_fn, s, (64, 2), random.key(0), steps=50)
    >>> x.shape
    torch.Size([64, 2])

The training losses live in ``torchfn.losses``: ``diffusion_loss``,
``flow_matching_loss``, ``mean_flow_loss``, ``edm_loss``, ``consistency_loss``,
``scm_loss``.
"""

from torchfn.transforms.diffusion._consistency import (
    consistency_function,
    consistency_levels,
    consistency_sample,
    consistency_scalings,
    trigflow_consistency,
    trigflow_sample,
)
from torchfn.transforms.diffusion._dpm_solver import dpm_solver_sample, dpm_solver_timesteps
from torchfn.transforms.diffusion._edm import edm_denoiser, edm_sample, edm_scalings, edm_sigmas
from torchfn.transforms.diffusion._euler import euler_levels, euler_sample
from torchfn.transforms.diffusion._flow_likelihood import flow_log_likelihood
from torchfn.transforms.diffusion._flow_matching import (
    flow_sample,
    flow_sigmas,
    resolution_shift_mu,
)
from torchfn.transforms.diffusion._guidance import classifier_free_guidance, drop_condition
from torchfn.transforms.diffusion._lcm import lcm_sample, lcm_timesteps, tcd_sample
from torchfn.transforms.diffusion._mean_flow import mean_flow_sample
from torchfn.transforms.diffusion._probability_flow import (
    probability_flow_log_likelihood,
    probability_flow_sample,
    reverse_sde_sample,
    vp_alpha_bar,
)
from torchfn.transforms.diffusion._q_sample import (
    PREDICTIONS,
    predict_eps_from_v,
    predict_eps_from_x0,
    predict_x0_from_eps,
    predict_x0_from_v,
    q_posterior,
    q_sample,
    velocity,
)
from torchfn.transforms.diffusion._samplers import (
    DynamicThreshold,
    ddim_sample,
    ddim_step,
    ddim_timesteps,
    ddpm_sample,
    ddpm_step,
)
from torchfn.transforms.diffusion._schedules import (
    Schedule,
    cosine_schedule,
    linear_schedule,
    schedule_from_betas,
    sigmoid_schedule,
)
from torchfn.transforms.diffusion._unipc import unipc_sample

__all__ = [
    "PREDICTIONS",
    "Schedule",
    "classifier_free_guidance",
    "consistency_function",
    "consistency_levels",
    "consistency_sample",
    "consistency_scalings",
    "cosine_schedule",
    "ddim_sample",
    "ddim_step",
    "ddim_timesteps",
    "ddpm_sample",
    "ddpm_step",
    "DynamicThreshold",
    "dpm_solver_sample",
    "dpm_solver_timesteps",
    "drop_condition",
    "edm_denoiser",
    "edm_sample",
    "edm_scalings",
    "edm_sigmas",
    "euler_levels",
    "euler_sample",
    "flow_log_likelihood",
    "flow_sample",
    "flow_sigmas",
    "resolution_shift_mu",
    "lcm_sample",
    "lcm_timesteps",
    "linear_schedule",
    "mean_flow_sample",
    "predict_eps_from_v",
    "predict_eps_from_x0",
    "predict_x0_from_eps",
    "predict_x0_from_v",
    "probability_flow_log_likelihood",
    "probability_flow_sample",
    "q_posterior",
    "q_sample",
    "reverse_sde_sample",
    "schedule_from_betas",
    "vp_alpha_bar",
    "sigmoid_schedule",
    "tcd_sample",
    "trigflow_consistency",
    "trigflow_sample",
    "unipc_sample",
    "velocity",
]

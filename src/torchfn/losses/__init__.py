"""Losses, written for a batch or for one example (batch with vmap)."""

from torchfn.losses._classification import (
    accuracy,
    binary_cross_entropy_with_logits,
    cross_entropy,
)
from torchfn.losses._consistency import consistency_loss
from torchfn.losses._contrastive import info_nce, ntxent, siglip
from torchfn.losses._ctc import ctc_loss
from torchfn.losses._diffusion import diffusion_loss, min_snr_weight
from torchfn.losses._ebm import ebm_loss
from torchfn.losses._edm import edm_loss
from torchfn.losses._flow_matching import flow_matching_loss, ot_pairing
from torchfn.losses._focal import focal_loss, sigmoid_focal_loss
from torchfn.losses._gan import gan_losses, gradient_penalty, wgan_losses
from torchfn.losses._linear_cross_entropy import linear_cross_entropy
from torchfn.losses._mean_flow import mean_flow_loss
from torchfn.losses._moe import moe_load_balance, moe_sequence_balance, router_z_loss
from torchfn.losses._mtp import multi_token_prediction
from torchfn.losses._policy import (
    completion_mask,
    group_advantages,
    grpo,
    kl_estimate,
    ppo,
    value_loss,
)
from torchfn.losses._preference import (
    bradley_terry,
    dpo,
    kto,
    orpo,
    sequence_log_probs,
    simpo,
    token_log_probs,
)
from torchfn.losses._regression import huber, l1, mse
from torchfn.losses._scm import scm_loss
from torchfn.losses._score_matching import score_matching
from torchfn.losses._vae import gaussian_kl, vae_elbo

__all__ = [
    # EBM and diffusion (torchfn.losses._ebm, _diffusion)
    "ebm_loss",
    "diffusion_loss",
    "min_snr_weight",
    "flow_matching_loss",
    "ot_pairing",
    "mean_flow_loss",
    "edm_loss",
    "consistency_loss",
    "scm_loss",
    "score_matching",
    # classification, regression, VAE, GAN (_classification, _regression, _vae, _gan)
    "cross_entropy",
    "linear_cross_entropy",
    "binary_cross_entropy_with_logits",
    "accuracy",
    "focal_loss",
    "sigmoid_focal_loss",
    "ctc_loss",
    # representation learning (_contrastive)
    "info_nce",
    "ntxent",
    "siglip",
    "mse",
    "huber",
    "l1",
    "vae_elbo",
    "gaussian_kl",
    "gradient_penalty",
    "wgan_losses",
    "gan_losses",
    # mixture-of-experts routers (_moe)
    "moe_load_balance",
    "moe_sequence_balance",
    "router_z_loss",
    # language models (_mtp), preference optimisation (_preference), policy gradients (_policy)
    "multi_token_prediction",
    "token_log_probs",
    "sequence_log_probs",
    "dpo",
    "simpo",
    "kto",
    "orpo",
    "bradley_terry",
    "group_advantages",
    "grpo",
    "ppo",
    "value_loss",
    "kl_estimate",
    "completion_mask",
]

"""Pure optimizers, gradient transformations, schedules and loss scaling.

A gradient transformation is torchopt's protocol (``init(params) -> state``,
``update(grads, state, params=None) -> (updates, state)``), so torchopt's
transforms chain with these. Updates are added to params (``apply_updates``);
nothing is mutated; states are NamedTuples of tensors that compile, vmap and
checkpoint.

    tx = chain(clip_by_global_norm(1.0), adamw(warmup_cosine(3e-4, 100, 10_000),
                                               mask=decay_mask))
    state = tx.init(params)
    updates, state = tx.update(grads, state, params)
    params = apply_updates(params, updates)
"""

from torchfn.optim._accumulate import MultiStepsState, multi_steps
from torchfn.optim._adabelief import AdaBeliefState, adabelief
from torchfn.optim._adadelta import AdadeltaState, adadelta
from torchfn.optim._adafactor import AdafactorState, adafactor
from torchfn.optim._adagrad import AdagradState, adagrad
from torchfn.optim._adam import AdamState, adam, adamw
from torchfn.optim._adamax import AdamaxState, adamax
from torchfn.optim._adan import AdanState, adan
from torchfn.optim._ademamix import AdEMAMixState, ademamix
from torchfn.optim._adopt import ADOPTState, adopt
from torchfn.optim._base import EmptyState, GradientTransformation, apply_updates, chain, identity
from torchfn.optim._cautious import DecayWeightsState, cautious, decay_weights
from torchfn.optim._clip import (
    adaptive_grad_clip,
    clip,
    clip_by_global_norm,
    global_norm,
    unitwise_norm,
)
from torchfn.optim._elementary import (
    ScaleByScheduleState,
    add_decayed_weights,
    scale,
    scale_by_schedule,
)
from torchfn.optim._ema import (
    EmaState,
    ema,
    ema_params,
    posthoc_ema,
    posthoc_ema_coefficients,
    power_ema_decay,
    sigma_rel_to_gamma,
)
from torchfn.optim._finite import ApplyIfFiniteState, all_finite, apply_if_finite
from torchfn.optim._hyperparams import InjectHyperparamsState, inject_hyperparams
from torchfn.optim._lamb import LambState, lamb, scale_by_trust_ratio
from torchfn.optim._laprop import LaPropState, laprop
from torchfn.optim._lbfgs import LbfgsState, lbfgs, scale_by_lbfgs
from torchfn.optim._linesearch import (
    LineSearchState,
    scale_by_backtracking_linesearch,
    scale_by_zoom_linesearch,
    value_and_grad_from_state,
)
from torchfn.optim._lion import LionState, lion
from torchfn.optim._lookahead import LookaheadState, lookahead
from torchfn.optim._masking import (
    MaskedState,
    PartitionState,
    decay_mask,
    freeze,
    masked,
    partition,
)
from torchfn.optim._muon import MuonState, muon, newton_schulz
from torchfn.optim._nadam import NAdamState, nadam
from torchfn.optim._plateau import PlateauSchedule, PlateauState, reduce_on_plateau
from torchfn.optim._precision import (
    DynamicLossScale,
    NoOpLossScale,
    Policy,
    select_tree,
)
from torchfn.optim._prodigy import ProdigyState, prodigy
from torchfn.optim._radam import RAdamState, radam
from torchfn.optim._rmsprop import RMSpropState, rmsprop
from torchfn.optim._schedule_free import (
    ScheduleFreeState,
    schedule_free_adamw,
    schedule_free_eval_params,
    schedule_free_sgd,
)
from torchfn.optim._schedules import (
    constant,
    cosine_annealing,
    cosine_warm_restarts,
    exponential_lr,
    linear_warmup,
    multistep_lr,
    one_cycle,
    scale_lr,
    step_lr,
    warmup_cosine,
)
from torchfn.optim._sgd import SGDState, sgd
from torchfn.optim._sgmcmc import PSGLDState, SGHMCState, SGLDState, psgld, sghmc, sgld
from torchfn.optim._soap import SOAPState, soap
from torchfn.optim._stable_adamw import StableAdamWState, stable_adamw

__all__ = [
    # protocol
    "GradientTransformation",
    "EmptyState",
    "chain",
    "identity",
    "apply_updates",
    # optimizers
    "adam",
    "adamw",
    "sgd",
    "sgld",
    "sghmc",
    "psgld",
    "PSGLDState",
    "SGLDState",
    "SGHMCState",
    "rmsprop",
    "adagrad",
    "lion",
    "nadam",
    "radam",
    "adamax",
    "adadelta",
    "adafactor",
    "lamb",
    "adabelief",
    "adan",
    "ademamix",
    "adopt",
    "soap",
    "laprop",
    "stable_adamw",
    "lbfgs",
    "muon",
    "prodigy",
    "schedule_free_adamw",
    "schedule_free_sgd",
    "schedule_free_eval_params",
    # transformations
    "clip_by_global_norm",
    "global_norm",
    "clip",
    "adaptive_grad_clip",
    "unitwise_norm",
    "lookahead",
    "scale_by_trust_ratio",
    "scale_by_lbfgs",
    "scale_by_backtracking_linesearch",
    "scale_by_zoom_linesearch",
    "value_and_grad_from_state",
    "newton_schulz",
    "scale",
    "scale_by_schedule",
    "add_decayed_weights",
    "decay_weights",
    "cautious",
    "masked",
    "partition",
    "freeze",
    "decay_mask",
    "multi_steps",
    "apply_if_finite",
    "all_finite",
    "inject_hyperparams",
    "ema",
    "ema_params",
    "power_ema_decay",
    "sigma_rel_to_gamma",
    "posthoc_ema",
    "posthoc_ema_coefficients",
    # schedules
    "constant",
    "step_lr",
    "multistep_lr",
    "exponential_lr",
    "cosine_annealing",
    "cosine_warm_restarts",
    "linear_warmup",
    "warmup_cosine",
    "one_cycle",
    "scale_lr",
    "reduce_on_plateau",
    # mixed precision
    "Policy",
    "DynamicLossScale",
    "NoOpLossScale",
    "select_tree",
    # states
    "AdamState",
    "SGDState",
    "RMSpropState",
    "AdagradState",
    "LionState",
    "NAdamState",
    "RAdamState",
    "AdamaxState",
    "AdadeltaState",
    "AdafactorState",
    "LambState",
    "AdaBeliefState",
    "AdanState",
    "AdEMAMixState",
    "ADOPTState",
    "SOAPState",
    "LaPropState",
    "StableAdamWState",
    "DecayWeightsState",
    "LbfgsState",
    "LineSearchState",
    "MuonState",
    "ScheduleFreeState",
    "LookaheadState",
    "ProdigyState",
    "MaskedState",
    "PartitionState",
    "MultiStepsState",
    "ApplyIfFiniteState",
    "InjectHyperparamsState",
    "EmaState",
    "ScaleByScheduleState",
    "PlateauState",
    "PlateauSchedule",
]

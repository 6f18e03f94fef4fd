"""Deep-learning rows of Table 1 (IVON, VOGN/OGN, Bayesian SAM, SGD/RMSprop/Adam as BLR) and
:class:`IVON` as a NumPyro ``SVI`` optimizer.

Each row is a diagonal Gaussian over the weights (:mod:`numpyro_blr.rules.diagonal`), an estimator
(:mod:`numpyro_blr.estimators.weights`) and the rule's options, composed in
:mod:`numpyro_blr.presets`; this module gathers them. See ``docs/deep-learning.md``.
"""

from numpyro_blr.core import Algorithm, StepInfo, predictive
from numpyro_blr.deep.svi import IVON, IVONSVIState
from numpyro_blr.estimators.weights import (
    gauss_newton_from_grads,
    gradient_from_grads,
    per_example_grads,
    price_from_samples,
    sharpness_aware_from_grads,
    sharpness_point,
)
from numpyro_blr.presets import adam_blr, bsam, ivon, ogn, rmsprop_blr, sgd_blr, vogn
from numpyro_blr.rules.diagonal import DiagonalRule, DiagonalState, diagonal_update
from numpyro_blr.tree import hash_normal, standard_normal

__all__ = [
    "Algorithm",
    "DiagonalRule",
    "DiagonalState",
    "IVON",
    "IVONSVIState",
    "StepInfo",
    "adam_blr",
    "bsam",
    "diagonal_update",
    "gauss_newton_from_grads",
    "gradient_from_grads",
    "hash_normal",
    "ivon",
    "ogn",
    "per_example_grads",
    "predictive",
    "price_from_samples",
    "rmsprop_blr",
    "sgd_blr",
    "sharpness_aware_from_grads",
    "sharpness_point",
    "standard_normal",
    "vogn",
]

"""Deep-learning BLR optimizers as pure JAX functions (IVON, VOGN/OGN, Bayesian SAM,
SGD/RMSprop/Adam as BLR), and :class:`IVON` as a NumPyro ``SVI`` optimizer.

See ``docs/deep-learning.md``.
"""

from numpyro_blr.deep.bsam import BSAM, BSAMState, bsam
from numpyro_blr.deep.classic import (
    BLROptimizer,
    GaussBLRState,
    SGDBLRState,
    adam_blr,
    rmsprop_blr,
    sgd_blr,
)
from numpyro_blr.deep.ivon import IVONFunctions, IVONState, hessian_update, ivon, predictive
from numpyro_blr.deep.svi import IVON, IVONSVIState
from numpyro_blr.deep.vogn import VOGN, VOGNState, ogn, per_example_grads, vogn

__all__ = [
    "BLROptimizer",
    "BSAM",
    "BSAMState",
    "GaussBLRState",
    "IVON",
    "IVONFunctions",
    "IVONSVIState",
    "IVONState",
    "SGDBLRState",
    "VOGN",
    "VOGNState",
    "adam_blr",
    "bsam",
    "hessian_update",
    "ivon",
    "ogn",
    "per_example_grads",
    "predictive",
    "rmsprop_blr",
    "sgd_blr",
    "vogn",
]

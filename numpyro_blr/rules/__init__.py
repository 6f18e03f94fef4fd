"""Update rules: the Bayesian learning rule for Gaussian natural parameters."""

from numpyro_blr.rules.blr import (
    diagonal_precision_update,
    full_precision_update,
    full_scale_tril_update,
    improved_precision_factor,
    inverse_scale_tril,
    momentum_update,
)

__all__ = [
    "diagonal_precision_update",
    "full_precision_update",
    "full_scale_tril_update",
    "improved_precision_factor",
    "inverse_scale_tril",
    "momentum_update",
]

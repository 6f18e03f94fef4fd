"""Exponential families: conversions between natural, expectation and user parameters."""

from numpyro_blr.families.bernoulli import Bernoulli, SignBernoulli
from numpyro_blr.families.beta import Beta
from numpyro_blr.families.categorical import Categorical
from numpyro_blr.families.dirichlet import Dirichlet
from numpyro_blr.families.gamma import Gamma
from numpyro_blr.families.gaussian import DiagonalGaussian, FullGaussian, precision_to_scale_tril

__all__ = [
    "Bernoulli",
    "Beta",
    "Categorical",
    "DiagonalGaussian",
    "Dirichlet",
    "FullGaussian",
    "Gamma",
    "SignBernoulli",
    "precision_to_scale_tril",
]

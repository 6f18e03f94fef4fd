"""Exponential families: conversions between natural, expectation and user parameters."""

from numpyro_blr.families.gaussian import DiagonalGaussian, FullGaussian, precision_to_scale_tril

__all__ = ["DiagonalGaussian", "FullGaussian", "precision_to_scale_tril"]

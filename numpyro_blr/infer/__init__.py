"""Inference algorithms built from the BLR: exact conjugate updates and VMP (:mod:`.conjugate`)."""

from numpyro_blr.infer.conjugate import ConjugateResult, NonConjugateError, conjugate_fit

__all__ = ["ConjugateResult", "NonConjugateError", "conjugate_fit"]

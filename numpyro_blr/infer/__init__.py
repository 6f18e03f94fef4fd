"""Inference algorithms built from the BLR beyond one SVI loop: VMP, non-conjugate VMP, EM (:mod:`.vmp`),
stochastic VI with minibatches (:mod:`.stochastic`), and exact conjugate updates (:mod:`.conjugate`)."""

from numpyro_blr.infer.conjugate import ConjugateResult, conjugate_fit
from numpyro_blr.infer.graph import ModelError, NonConjugateError
from numpyro_blr.infer.stochastic import svi
from numpyro_blr.infer.vmp import FitResult, MessagePassing, SweepInfo, VMPState, em, ncvmp, vmp

__all__ = ["ConjugateResult", "FitResult", "MessagePassing", "ModelError", "NonConjugateError", "SweepInfo",
           "VMPState", "conjugate_fit", "em", "ncvmp", "svi", "vmp"]

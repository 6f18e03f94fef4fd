"""ArviZ diagnostics and the Bayesian workflow for BLR (and any NumPyro SVI) fits.

* :func:`to_datatree`: a fitted guide to an ``xarray.DataTree`` (posterior, posterior predictive,
  pointwise log likelihood, observed data, importance densities, fit history) for ArviZ 1.x.
* :func:`check_fit`, :func:`check_guide`, :func:`psis`: Pareto k-hat of the variational fit
  (Yao et al. 2018); :func:`psis_expectation`: PSIS-corrected expectations; :func:`loo_vi`:
  LOO-CV with the approximate-posterior correction (Magnusson et al. 2019).
* :mod:`~numpyro_blr.diagnostics.plots`: loss trace, forest plot of several fits, k-hat plots (PNG).
* :func:`memory_perturbation`: per-example sensitivity and leave-one-out predictions without
  refitting (Nickl et al. 2023).
"""

from numpyro_blr.diagnostics.convert import DiagnosticsError, model_sites, posterior_draws, to_datatree
from numpyro_blr.diagnostics.psis import (
    PSISResult,
    check_fit,
    check_guide,
    has_density,
    khat_verdict,
    log_densities,
    loo_vi,
    psis,
    psis_expectation,
)
from numpyro_blr.diagnostics.sensitivity import (
    MemoryPerturbation,
    gaussian_from_params,
    memory_perturbation,
)

__all__ = [
    "DiagnosticsError",
    "MemoryPerturbation",
    "PSISResult",
    "check_fit",
    "check_guide",
    "gaussian_from_params",
    "has_density",
    "khat_verdict",
    "log_densities",
    "loo_vi",
    "memory_perturbation",
    "model_sites",
    "posterior_draws",
    "psis",
    "psis_expectation",
    "to_datatree",
]

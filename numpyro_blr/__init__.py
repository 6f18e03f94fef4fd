"""numpyro_blr: the Bayesian learning rule (Khan & Rue 2023) for NumPyro.

``nb.diagnostics`` (ArviZ, xarray, scipy) is imported on first use, so that ``import numpyro_blr``
costs little more than ``import numpyro`` (``bench/bench_import.py``).
"""

import importlib

from numpyro_blr import deep, infer, mixture
from numpyro_blr.deep import IVON, adam_blr, bsam, ivon, ogn, rmsprop_blr, sgd_blr, vogn
from numpyro_blr.guides import ExpFamilyGuide
from numpyro_blr.families import Bernoulli, Beta, Categorical, DiagonalGaussian, Dirichlet, FullGaussian, Gamma
from numpyro_blr.infer import conjugate_fit
from numpyro_blr.layout import GuideLayoutError, read_layout
from numpyro_blr.optim import BLR, BLRState
from numpyro_blr.report import FitTrace
from numpyro_blr.rules.schedules import adaptive_decay, harmonic_decay
from numpyro_blr.svi import GuideState, nonfinite_parameters
from numpyro_blr.report import FitReport, fit_report
from numpyro_blr.presets import (
    bayesbinn,
    gradient_descent,
    laplace,
    lie_additive,
    lie_affine,
    lie_multiplicative,
    mixture_blr,
    multimodal_optimization,
    newton,
    von,
)
from numpyro_blr.liegroup_guide import LieGroupBLR, LieGroupGuide
from numpyro_blr.rules.liegroup import Rayleigh
from numpyro_blr.rules.diagonal import DiagonalPrior, perturbed
from numpyro_blr.svi import as_optax  # the rows' optax view; refuses nb.BLR()/nb.IVON() with what to use
from numpyro_blr.core import Algorithm, StepInfo, predictive
from numpyro_blr.compile_once import Trace_ELBO, enable_compilation_cache, fit
from numpyro_blr import parallel
from numpyro_blr.parallel import (
    ScaleError,
    check_data_sharding,
    check_guide_memory,
    collective_counts,
    data_mesh,
    data_parallel_estimate,
    data_parallel_step,
    replicate,
    shard_data,
    shard_state,
)

__all__ = [
    "Algorithm",
    "Trace_ELBO",
    "enable_compilation_cache",
    "fit",
    "workflow",
    "BLR",
    "StepInfo",
    "as_optax",
    "perturbed",
    "DiagonalPrior",
    "predictive",
    "ExpFamilyGuide",
    "LieGroupBLR",
    "LieGroupGuide",
    "Rayleigh",
    "lie_additive",
    "lie_affine",
    "lie_multiplicative",
    "IVON",
    "adam_blr",
    "bsam",
    "deep",
    "diagnostics",
    "online",
    "infer",
    "mixture",
    "mixture_blr",
    "multimodal_optimization",
    "bayesbinn",
    "conjugate_fit",
    "Bernoulli",
    "Beta",
    "Categorical",
    "Dirichlet",
    "Gamma",
    "ivon",
    "ogn",
    "rmsprop_blr",
    "sgd_blr",
    "vogn",
    "BLRState",
    "GuideState",
    "FitReport",
    "FitTrace",
    "adaptive_decay",
    "fit_report",
    "DiagonalGaussian",
    "FullGaussian",
    "GuideLayoutError",
    "gradient_descent",
    "harmonic_decay",
    "laplace",
    "newton",
    "nonfinite_parameters",
    "read_layout",
    "von",
    "parallel",
    "ScaleError",
    "check_data_sharding",
    "check_guide_memory",
    "collective_counts",
    "data_mesh",
    "data_parallel_estimate",
    "data_parallel_step",
    "replicate",
    "shard_data",
    "shard_state",
]
__version__ = "0.1.0"

_LAZY_SUBMODULES = ("diagnostics", "online", "workflow")


def __getattr__(name):
    if name in _LAZY_SUBMODULES:
        module = importlib.import_module(f"numpyro_blr.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module 'numpyro_blr' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY_SUBMODULES))

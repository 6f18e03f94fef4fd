"""Reading a guide's Gaussian out of the unconstrained parameters that SVI hands the optimizer.

NumPyro's ``SVI`` gives its optimizer only a dict of *unconstrained* parameter values. The
autoguides name their parameters predictably (prefix ``auto`` by default):

==========================  ==========================================  =========
guide                       parameters                                  block
==========================  ==========================================  =========
``AutoNormal``              ``{site}_auto_loc``, ``{site}_auto_scale``  diagonal
``AutoDiagonalNormal``      ``auto_loc``, ``auto_scale``                diagonal
``AutoMultivariateNormal``  ``auto_loc``, ``auto_scale_tril``           full
``AutoDelta``               ``{site}_auto_loc``                         point
``AutoLaplaceApproximation`` ``auto_loc``                               point
``ExpFamilyGuide``          ``{site}_blr_normal_loc``/``_normal_scale``  diagonal
``ExpFamilyGuide``          ``{site}_blr_{family}_{param}``             expfam
==========================  ==========================================  =========

Scales are stored through ``softplus`` (``constraints.softplus_positive``) and the Cholesky
factor through ``ScaledUnitLowerCholeskyTransform``; :class:`GaussianBlock` keeps those
transforms so that the optimizer converts exactly between raw values and ``(m, s)`` or
``(m, L)``. Anything else is reported by :func:`read_layout` so that the caller can hand it to a
fallback optimizer or reject it by name.
"""

import re
from dataclasses import dataclass, field
from typing import Optional

from numpyro.distributions import constraints
from numpyro.distributions.transforms import biject_to

DIAGONAL = "diagonal"
FULL = "full"
POINT = "point"
EXPFAM = "expfam"

# ExpFamilyGuide (numpyro_blr.guides) names its parameters ``{site}_{prefix}_{family}_{param}``;
# every parameter of one family must be present for the site to be read as a block. ``normal``
# sites become ordinary diagonal Gaussian blocks (softplus scale); the others are EXPFAM blocks,
# updated by numpyro_blr.expfam_blocks.
EXPFAM_PARAMS = {
    "normal": ("loc", "scale"),
    "gamma": ("concentration", "rate"),
    "beta": ("concentration1", "concentration0"),
    "dirichlet": ("concentration",),
    "bernoulli": ("logits",),
    "categorical": ("logits",),
}


@dataclass(frozen=True)
class GaussianBlock:
    """One Gaussian factor of the guide: its mean parameter and (unless a point mass) its scale parameter."""

    kind: str
    loc: str
    scale: Optional[str] = None
    scale_constraint: object = field(default=None, compare=False)

    @property
    def transform(self):
        """The bijection from the raw (unconstrained) scale parameter to ``s`` or ``L``."""
        return biject_to(self.scale_constraint)


@dataclass(frozen=True)
class ExpFamBlock:
    """One ExpFamilyGuide site with a non-Gaussian family; ``names`` are its raw parameters in
    the order of :data:`EXPFAM_PARAMS`, ``loc`` the first of them (a handle for per-block state)."""

    kind: str
    loc: str
    family: str
    names: tuple
    stem: str


def _read_expfam(params, used):
    """ExpFamilyGuide blocks: ``{stem}_{family}_{param}`` names with all of the family's params."""
    blocks = []
    for name in sorted(params):
        if name in used:
            continue
        for family, pnames in EXPFAM_PARAMS.items():
            suffix = f"_{family}_{pnames[0]}"
            if not name.endswith(suffix) or len(name) == len(suffix):
                continue
            stem = name[: -len(suffix)]
            names = tuple(f"{stem}_{family}_{p}" for p in pnames)
            if not all(n in params and n not in used for n in names):
                continue
            if family == "normal":
                if params[names[1]].shape != params[names[0]].shape:
                    raise GuideLayoutError(
                        f"{names[0]!r} has shape {params[names[0]].shape} but {names[1]!r} has shape "
                        f"{params[names[1]].shape}: a diagonal Gaussian needs equal shapes."
                    )
                blocks.append(GaussianBlock(DIAGONAL, names[0], names[1], constraints.softplus_positive))
            else:
                blocks.append(ExpFamBlock(EXPFAM, names[0], family, names, stem))
            used.update(names)
            break
    return blocks


@dataclass(frozen=True)
class Layout:
    blocks: tuple
    other: tuple  # parameter names that are not part of any Gaussian block

    @property
    def loc_names(self):
        return tuple(b.loc for b in self.blocks)


class GuideLayoutError(ValueError):
    """The optimizer cannot read the guide's parameters as Gaussian blocks."""


def read_layout(params, prefix="auto", scale_constraint=None, scale_tril_constraint=None):
    """Split ``params`` (a dict name -> array) into Gaussian blocks and other parameters.

    ``scale_constraint`` / ``scale_tril_constraint`` default to NumPyro's autoguide defaults
    (``softplus_positive`` and ``scaled_unit_lower_cholesky``); pass the guide's own when it
    was built with different ones (``nb.BLR(guide=guide)`` does this for you).
    """
    if not isinstance(params, dict):
        raise GuideLayoutError(
            f"BLR expects the dict of parameters that numpyro's SVI builds, got {type(params).__name__}."
        )
    scale_constraint = scale_constraint or constraints.softplus_positive
    scale_tril_constraint = scale_tril_constraint or constraints.scaled_unit_lower_cholesky
    loc_re = re.compile(rf"^(?:(?P<site>.+)_)?{re.escape(prefix)}_loc$")
    blocks, used = [], set()
    for name in sorted(params):
        match = loc_re.match(name)
        if not match:
            continue
        stem = name[: -len("_loc")]
        scale, tril, cov_factor = f"{stem}_scale", f"{stem}_scale_tril", f"{stem}_cov_factor"
        if cov_factor in params:
            raise GuideLayoutError(
                f"Parameters {name!r}, {scale!r}, {cov_factor!r} look like AutoLowRankMultivariateNormal: "
                "its low-rank covariance has no natural-gradient update in BLR. Use AutoMultivariateNormal "
                "(full covariance) or AutoNormal (diagonal) with nb.BLR, or fit this guide with an optax optimizer."
            )
        loc_shape = params[name].shape
        if tril in params:
            d = loc_shape[-1] if loc_shape else 1
            if len(loc_shape) != 1 or params[tril].shape[-1] != d * (d + 1) // 2:
                raise GuideLayoutError(
                    f"{name!r} (shape {loc_shape}) and {tril!r} (shape {params[tril].shape}) do not form a "
                    "full-covariance Gaussian over one vector."
                )
            blocks.append(GaussianBlock(FULL, name, tril, scale_tril_constraint))
            used.update((name, tril))
        elif scale in params:
            if params[scale].shape != loc_shape:
                raise GuideLayoutError(
                    f"{name!r} has shape {loc_shape} but {scale!r} has shape {params[scale].shape}: "
                    "BLR reads a diagonal Gaussian only when loc and scale have the same shape."
                )
            blocks.append(GaussianBlock(DIAGONAL, name, scale, scale_constraint))
            used.update((name, scale))
        else:
            blocks.append(GaussianBlock(POINT, name))
            used.add(name)
    blocks += _read_expfam(params, used)
    other = tuple(sorted(set(params) - used))
    return Layout(tuple(blocks), other)

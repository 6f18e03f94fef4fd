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

import dataclasses
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from numpyro.distributions import constraints
from numpyro.distributions.transforms import ScaledUnitLowerCholeskyTransform, biject_to

from numpyro_blr.families.registry import FAMILIES, GUIDE_FAMILIES

DIAGONAL = "diagonal"
FULL = "full"
POINT = "point"
EXPFAM = "expfam"


@dataclass(frozen=True)
class GaussianBlock:
    """One Gaussian factor of the guide: its mean parameter and (unless a point mass) its scale parameter."""

    kind: str
    loc: str
    scale: Optional[str] = None
    scale_constraint: object = field(default=None, compare=False)
    # the sizes of the sites packed one after another into a diagonal block's raveled loc (AutoDiagonalNormal's
    # one vector; :func:`site_segments`), () for a block of one site
    segments: tuple = ()

    @property
    def transform(self):
        """The bijection from the raw (unconstrained) scale parameter to ``s`` or ``L``."""
        if self.scale_constraint is constraints.scaled_unit_lower_cholesky:
            return GatherScaledUnitLowerCholesky()
        return biject_to(self.scale_constraint)

    def scaling_tangent(self, raw):
        r""":math:`\partial x/\partial c` at :math:`c = 1` of the raw scale :math:`x(c) = T^{-1}(c\,T(x))`: the
        direction of the raw parameter in which ``s`` or ``L`` grows by the factor :math:`1 + dc`.

        NumPyro's defaults in closed form, one transcendental: with :math:`s = \operatorname{softplus}(x)`,
        :math:`\partial x/\partial s = 1/\sigma(x) = 1/(1 - e^{-s})`, so :math:`\partial x/\partial c = s/(1 - e^{-s})`
        (for ``scaled_unit_lower_cholesky`` on the softplus diagonal; its unit-lower part does not move).
        Other constraints: the JVP of the inverse transform (XLA on CPU compiles the JVP of
        :math:`\log(-\operatorname{expm1}(-s))` into a 20 KB kernel; this one is 6 KB).
        """
        scale = self.transform(raw)
        if self.scale_constraint is constraints.softplus_positive:
            return scale / -jnp.expm1(-scale)
        if self.scale_constraint is constraints.scaled_unit_lower_cholesky:
            s = jnp.diagonal(scale, axis1=-2, axis2=-1)
            strict = jnp.zeros(raw.shape[:-1] + (raw.shape[-1] - s.shape[-1],), raw.dtype)
            return jnp.concatenate([strict, s / -jnp.expm1(-s)], axis=-1)
        return jax.jvp(self.transform.inv, (scale,), (scale,))[1]


_COMPILED_TRANSFORMS = {}


def _compiled_transform(constraint, inverse):
    key = (id(constraint), inverse)  # constraints are module-level instances; the entry holds this one
    if key not in _COMPILED_TRANSFORMS:
        block = GaussianBlock(FULL, "", "", constraint)
        transform = block.transform.inv if inverse else block.transform
        _COMPILED_TRANSFORMS[key] = (constraint, jax.jit(lambda x: transform(x)))  # transforms are not hashable
    return _COMPILED_TRANSFORMS[key][1]


def _numpy_forward(constraint, x):
    """The forward transform of the common scale constraints in NumPy (None for the others): the end-of-run
    report reads ``s`` or ``L`` once per fit, and a compiled JAX transform costs a compilation (0.05-0.3 s) in
    every new process, for one evaluation. Same formulas as :class:`GatherScaledUnitLowerCholesky` and NumPyro's
    transforms (equal to rounding)."""
    x = np.asarray(x)
    if constraint is constraints.softplus_positive:
        return np.logaddexp(np.zeros((), x.dtype), x)
    if constraint is constraints.positive:
        return np.exp(x)
    if constraint is constraints.scaled_unit_lower_cholesky:
        n = round((np.sqrt(1 + 8 * x.shape[-1]) - 1) / 2)
        fill, _ = _tril_gather_indices(n)
        strict = np.concatenate([x[..., :-n], np.zeros(x.shape[:-1] + (1,), x.dtype)], axis=-1)
        unit = np.take(strict, fill, axis=-1).reshape(x.shape[:-1] + (n, n)) + np.eye(n, dtype=x.dtype)
        return unit * np.logaddexp(np.zeros((), x.dtype), x[..., -n:])[..., None]
    return None


def apply_transform(block, x, inverse=False):
    """``block.transform(x)`` (or its inverse) where ``x`` is concrete: the forward transform of the common
    constraints in NumPy, anything else compiled as one program (op by op, each operation of a transform is
    compiled on first use: 0.5 s for ``AutoMultivariateNormal``'s, at the end of every first run in a process);
    under a trace, the transform itself."""
    if isinstance(x, jax.core.Tracer):
        return block.transform.inv(x) if inverse else block.transform(x)
    if not inverse:
        y = _numpy_forward(block.scale_constraint, x)
        if y is not None:
            return y
    return _compiled_transform(block.scale_constraint, bool(inverse))(x)


@lru_cache(maxsize=None)
def _tril_gather_indices(n):
    """Constant indices for :class:`GatherScaledUnitLowerCholesky` (``n x n`` matrices)."""
    rows, cols = np.tril_indices(n, -1)
    flat = rows * n + cols  # row-major positions of the strictly lower entries, in NumPyro's order
    fill = np.full(n * n, flat.size, dtype=np.int32)  # index flat.size points at an appended zero
    fill[flat] = np.arange(flat.size, dtype=np.int32)
    return fill, flat.astype(np.int32)


class GatherScaledUnitLowerCholesky(ScaledUnitLowerCholeskyTransform):
    """NumPyro's ``ScaledUnitLowerCholeskyTransform`` (``AutoMultivariateNormal``'s ``scale_tril``), with the
    same values, written with gathers only.

    NumPyro builds the matrix with a ``scatter_add``, which XLA runs element by element on CPU
    (about 11 us for a 31 x 31 factor, a third of a whole Adam step on the breast-cancer model);
    a gather from constant indices does the same in about 1 us, and so do the inverse and its
    vector-Jacobian product, which the BLR step uses on every step.
    """

    def __call__(self, x):
        n = round((np.sqrt(1 + 8 * x.shape[-1]) - 1) / 2)
        fill, _ = _tril_gather_indices(n)
        strict = jnp.concatenate([x[..., :-n], jnp.zeros(x.shape[:-1] + (1,), x.dtype)], axis=-1)
        unit = jnp.take(strict, fill, axis=-1).reshape(x.shape[:-1] + (n, n)) + jnp.eye(n, dtype=x.dtype)
        return unit * jax.nn.softplus(x[..., -n:])[..., None]

    def _inverse(self, y):
        n = y.shape[-1]
        _, flat = _tril_gather_indices(n)
        diag = jnp.diagonal(y, axis1=-2, axis2=-1)
        strict = jnp.take((y / diag[..., None]).reshape(y.shape[:-2] + (n * n,)), flat, axis=-1)
        # materialised before the concatenation: XLA on CPU fuses the transcendental into the
        # concatenate's kernel as 31 KB of code, against 6 KB apart (compile time follows code size)
        raw_diag = jax.lax.optimization_barrier(diag + jnp.log(-jnp.expm1(-diag)))
        return jnp.concatenate([strict, raw_diag], axis=-1)

    def cotangent_to_tril(self, y, raw_cotangent, transpose=False):
        r"""The vector-Jacobian product of :meth:`_inverse` at ``y = L``: maps :math:`\partial f/\partial x`
        (``x`` the raw vector) to the lower-triangular :math:`\partial f/\partial L` (its transpose
        with ``transpose=True``, gathered directly so that no transpose reaches a matrix product),
        with gathers only.

        With :math:`L = \operatorname{diag}(s)(U + I)`, :math:`s = \operatorname{softplus}(x_{\rm diag})`:
        :math:`\partial f/\partial L_{ij} = (\partial f/\partial U_{ij}) / s_i` below the diagonal and
        :math:`\partial f/\partial L_{ii} = (\partial f/\partial x_i)/\sigma(x_i) - \sum_{j<i} \partial f/\partial L_{ij}\, U_{ij}`,
        :math:`\sigma` the logistic function (the derivative of softplus), :math:`\sigma(x_i) = 1 - e^{-s_i}`.
        """
        n = y.shape[-1]
        fill, _ = _tril_gather_indices(n)
        c = raw_cotangent
        s = jnp.diagonal(y, axis1=-2, axis2=-1)
        strict = jnp.concatenate([c[..., :-n], jnp.zeros(c.shape[:-1] + (1,), c.dtype)], axis=-1)
        grad_u = jnp.take(strict, fill, axis=-1).reshape(c.shape[:-1] + (n, n))
        lower = grad_u / s[..., None]  # zero on and above the diagonal
        diag = c[..., -n:] / -jnp.expm1(-s) - jnp.sum(lower * (y / s[..., None]), axis=-1)
        if transpose:
            upper = jnp.take(strict, fill.reshape(n, n).T.reshape(-1), axis=-1).reshape(c.shape[:-1] + (n, n))
            return upper / s[..., None, :] + diag[..., None] * jnp.eye(n, dtype=y.dtype)
        return lower + diag[..., None] * jnp.eye(n, dtype=y.dtype)


@dataclass(frozen=True)
class ExpFamBlock:
    """One ExpFamilyGuide site with a non-Gaussian family; ``names`` are its raw parameters in
    the registry's order (``FAMILIES[family].params``), ``loc`` the first of them (a handle for per-block state)."""

    kind: str
    loc: str
    family: str
    names: tuple
    stem: str


def _read_expfam(params, used):
    """ExpFamilyGuide blocks: ``{stem}_{family}_{param}`` names with all of the family's params (the
    registry's ``params``). ``normal`` sites are diagonal Gaussian blocks, the others EXPFAM blocks
    (updated by :mod:`numpyro_blr.expfam_blocks`)."""
    blocks = []
    for name in sorted(params):
        if name in used:
            continue
        for family in GUIDE_FAMILIES:
            pnames = FAMILIES[family].params
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
                blocks.append(GaussianBlock(DIAGONAL, names[0], names[1], FAMILIES[family].constraints[1]))
            else:
                blocks.append(ExpFamBlock(EXPFAM, names[0], family, names, stem))
            used.update(names)
            break
    return blocks


@dataclass(frozen=True)
class Layout:
    blocks: tuple
    other: tuple  # parameter names that are not part of any Gaussian block


def site_segments(layout, params, guide, prefix="auto"):
    """``layout`` with the sizes of the sites that ``guide`` (NumPyro's ``AutoDiagonalNormal``, or another
    ``AutoContinuous`` guide whose one vector is a diagonal block) packs into its ``'{prefix}_loc'``, in the order of its
    latent vector (NumPyro's ``_init_locs``, raveled site by site), as that block's ``segments``. Unchanged where the
    guide has not been set up, packs one site, or its sizes do not add up to the block's."""
    locs = getattr(guide, "_init_locs", None)
    name = f"{prefix}_loc"
    if not isinstance(locs, dict) or len(locs) < 2 or name not in params:
        return layout
    sizes = tuple(int(np.prod(np.shape(v), dtype=np.int64)) for v in locs.values())
    if sum(sizes) != int(np.size(params[name])) or np.ndim(params[name]) != 1:
        return layout
    blocks = tuple(dataclasses.replace(b, segments=sizes) if b.loc == name and b.kind == DIAGONAL else b
                   for b in layout.blocks)
    return Layout(blocks, layout.other)


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

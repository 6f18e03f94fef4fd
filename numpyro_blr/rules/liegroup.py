r"""The Lie-group Bayesian learning rule (Kiral, Moellenhoff & Khan 2023): three groups as rules.

The posterior candidate is the push-forward of a base distribution :math:`q_0` by a group element
:math:`g`, :math:`\theta = g\cdot\xi`, :math:`\xi \sim q_0`, and the rule moves :math:`g` by the
group's exponential map, :math:`g \leftarrow g\exp(-\rho\,\hat X)`, so that every step stays in the
group (scales stay positive) whatever the estimate and the step size. :math:`q_0` need not be an
exponential family: any reparameterisable NumPyro distribution (Gaussian, Student-t, Laplace,
logistic, uniform, :class:`Rayleigh`, ...). Three groups, elementwise over a flat weight vector:

======================  ===========================================  ================================
group                   :math:`\theta`                                 state
======================  ===========================================  ================================
additive                :math:`w + \xi` (:math:`q_0` fixed)            ``loc`` :math:`w`
multiplicative          :math:`g\,\xi` (:math:`\xi > 0`), or signed    ``scale`` :math:`g`, or
                        :math:`g_+\xi_+ - g_-\xi_-`                     :math:`(g_+, g_-)` end to end
diagonal affine         :math:`b + A\,\epsilon`                        ``loc`` :math:`b`, ``scale`` :math:`A`
======================  ===========================================  ================================

**Objective and gradient.** With :math:`\bar\ell` the average mini-batch loss, :math:`N` the effective
sample size (``ess``), :math:`\delta` the ``weight_decay`` and :math:`T` the ``temperature``, the rules
minimise :math:`\mathbb E_{q_g}[\bar\ell(\theta) + \tfrac{\delta}{2}\|\theta\|^2] - \tfrac{T}{N}\mathbb H[q_g]`
(in SVI, :math:`N = T = 1` and :math:`\bar\ell` is minus the log joint). Its gradient in the Lie algebra
(the derivative along :math:`g\exp(tX)`) follows from the reparameterisation :math:`\theta = g\cdot\xi`
(Sec. 3.3 of the paper), with :math:`G = \nabla\bar\ell(\theta) + \delta\theta` at a draw (the prior is
sampled with the loss, as in the paper):

.. math::
    \text{affine (natural units, times } N/T\text{):}\quad X_b = \tfrac{N}{T} A\,\mathbb E[G], \quad
        X_A = \tfrac{N}{T}\mathbb E[A\epsilon\, G] - 1; \qquad
    \text{multiplicative (per example):}\quad X_\pm = \mathbb E[\pm g_\pm\xi_\pm\, G] - \tfrac{T}{N},

the :math:`-1` (:math:`-T/N`) being the entropy's derivative along a log-scale. The units make ``lr`` a
usable step size in each group: the affine shift step is then a Newton step in the per-example curvature
(as IVON's) whatever :math:`T`, and the multiplicative step, in :math:`\log g`, is independent of the
temperature (the paper's cold posteriors, :math:`T \ll 1`). In SVI both are the same.

**The step.** The natural gradient divides by the Fisher metric of the family, which at the
identity depends only on :math:`q_0` (App. A of the paper): per coordinate
:math:`c_b = \mathbb E[\psi(\epsilon)^2]` and :math:`c_A = \mathbb E[(1 + \epsilon\psi(\epsilon))^2]`,
:math:`\psi = (\log q_0)'` (:func:`fisher_metric`; Gaussian :math:`(1/\sigma_0^2, 2)`, Student-t
:math:`((\nu+1)/((\nu+3)\sigma_0^2), 2\nu/(\nu+3))`, Rayleigh :math:`c = 4`; the cross term, zero for
a symmetric :math:`q_0`, is dropped). Momentum is an exponential average of the algebra gradient
(:math:`M \leftarrow \beta M + (1-\beta)X/c`, the paper's Algorithms 2-3, no bias correction). With
step sizes :math:`\rho` (``lr``) and :math:`\rho_A` (``scale_lr``; the same for the multiplicative
group) the exponential maps are, elementwise,

.. math::
    \text{multiplicative:}\quad g &\leftarrow g\, e^{-\rho M}, \\
    \text{affine:}\quad A &\leftarrow A\, e^{-z}, \quad z = \rho_A M_A, \qquad
    b \leftarrow b - \rho\, A\, M_b\, \varphi(z), \quad \varphi(z) = \frac{1 - e^{-z}}{z},

the closed form of :math:`(A, b)\exp(-(\rho_A M_A, \rho M_b))` for the diagonal affine group
(:math:`\varphi(0) = 1`). To first order in the step the affine step with a Gaussian :math:`q_0`
is the diagonal Gaussian BLR step with :math:`\rho`:
:math:`1/A^2 \leftarrow (1-\rho)/A^2 + \rho\hat h`, :math:`b \leftarrow b - \rho A^2\hat g`.

The additive group has no entropy term and a constant metric, so its step is gradient descent on
the perturbed weights, written as ``optax.sgd``: :math:`t \leftarrow G + \beta t`,
:math:`w \leftarrow w - \rho t` with :math:`G = \nabla\bar\ell(\theta) + \delta\theta` (per-example
units: with a Dirac :math:`q_0` it *is* ``optax.sgd(lr, momentum)``).

Scales are clamped to :math:`[\text{tiny}, \text{max}]` of their dtype after the exponential, so
they stay strictly positive and finite for any finite gradient and step size (in float32 too); a
step whose estimate or result is not finite is skipped (the state kept, ``skipped`` counted).
The point estimate (``state.params``) is the mean of :math:`q`: :math:`w + \mathbb E[\xi]`,
:math:`b + A\,\mathbb E[\epsilon]`, :math:`\mathbb E[\xi](g_+ - g_-)` (:math:`\mathbb E[\xi] =
\sqrt{\pi/2}` for Rayleigh(1), not 1).
"""

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from numpyro.distributions import constraints

from numpyro_blr.core import StepInfo, check_params, select, skip_decision, value_at
from numpyro_blr.families.registry import is_positive_support
from numpyro_blr.tree import FlatLayout, finite_check

GROUPS = ("additive", "multiplicative", "affine")


# ----------------------------------------------------------------------------- q0


class Rayleigh(dist.Distribution):
    r"""The Rayleigh distribution, :math:`p(x) = \frac{x}{\sigma^2} e^{-x^2/(2\sigma^2)}`, :math:`x > 0`:
    the multiplicative group's default :math:`q_0` (mean :math:`\sigma\sqrt{\pi/2}`). Reparameterised
    (inverse CDF :math:`\sigma\sqrt{-2\log(1-u)}`)."""

    arg_constraints = {"scale": constraints.positive}
    support = constraints.positive
    reparametrized_params = ["scale"]

    def __init__(self, scale=1.0, *, validate_args=None):
        self.scale = scale
        super().__init__(batch_shape=jnp.shape(scale), validate_args=validate_args)

    def sample(self, key, sample_shape=()):
        shape = tuple(sample_shape) + self.batch_shape
        u = jax.random.uniform(key, shape, minval=jnp.finfo(jnp.result_type(float)).tiny, maxval=1.0)
        return self.scale * jnp.sqrt(-2.0 * jnp.log(u))

    def log_prob(self, value):
        z = value / self.scale
        return jnp.log(z) - jnp.log(self.scale) - 0.5 * z * z

    def cdf(self, value):
        z = value / self.scale
        return -jnp.expm1(-0.5 * z * z)

    def icdf(self, q):
        return self.scale * jnp.sqrt(-2.0 * jnp.log1p(-q))

    @property
    def mean(self):
        return self.scale * math.sqrt(math.pi / 2)

    @property
    def variance(self):
        return (2.0 - math.pi / 2) * self.scale**2


def check_base(base, where, group, positive=False):
    r"""Raise ``ValueError`` naming ``where`` (a site, a leaf, or the argument) unless ``base`` can be
    :math:`q_0` for ``group``: a univariate reparameterisable NumPyro distribution (``None`` is a Dirac
    :math:`q_0`, for the additive group only), positive for the multiplicative group."""
    if base is None:
        if group != "additive":
            raise ValueError(
                f"{where}: a Dirac q0 (base=None) has no entropy or Fisher metric; the {group} group needs a "
                "distribution. Use the additive group for gradient descent, or a base such as dist.Normal(0, 1)."
            )
        return
    if not isinstance(base, dist.Distribution):
        raise ValueError(f"{where}: base must be a numpyro distribution (q0), got {type(base).__name__}.")
    if isinstance(base, dist.Delta):
        raise ValueError(f"{where}: dist.Delta as q0 is a point mass: pass base=None for a Dirac q0 (additive group only).")
    if base.support.is_discrete or not base.has_rsample:
        raise ValueError(
            f"{where}: q0 = {type(base).__name__} cannot be reparameterised (has_rsample is False): the Lie-group "
            "BLR reads its gradient through theta = g . xi, so q0 needs a reparameterised sampler "
            "(Normal, StudentT, Laplace, Logistic, Uniform, Cauchy, nb.Rayleigh, Gamma, ...)."
        )
    if base.batch_shape != () or base.event_shape != ():
        raise ValueError(
            f"{where}: q0 must be a univariate distribution with scalar parameters (drawn elementwise), got "
            f"batch shape {base.batch_shape} and event shape {base.event_shape}."
        )
    if (group == "multiplicative" or positive) and not is_positive_support(base.support):
        raise ValueError(
            f"{where}: the multiplicative group needs a positive q0 (theta = g * xi with xi > 0), got "
            f"{type(base).__name__} with support {base.support}; use nb.Rayleigh(), dist.Gamma(k), "
            "dist.HalfNormal(), dist.LogNormal(...)."
        )


def base_mean(base):
    r""":math:`\mathbb E[\xi]` of :math:`q_0` (``base=None``: 0); its location where the mean is not finite (Cauchy)."""
    if base is None:
        return 0.0
    try:
        m = float(base.mean)
    except Exception:  # noqa: BLE001
        m = float("nan")
    if math.isfinite(m):
        return m
    return float(getattr(base, "loc", 0.0))


def base_quantile(base, q):
    """Quantiles ``q`` of :math:`q_0`: its ``icdf`` where numpyro has one, scipy's ``ppf`` for Student-t, Gamma and
    Weibull (numpyro needs TensorFlow Probability for those), else the empirical quantiles of :math:`2^{18}` draws
    (fixed key)."""
    try:
        return base.icdf(jnp.asarray(q))
    except (ImportError, NotImplementedError):
        pass
    from scipy import stats

    q = np.asarray(q, np.float64)
    if isinstance(base, dist.StudentT):
        out = stats.t.ppf(q, _float(base.df), _float(base.loc), _float(base.scale))
    elif isinstance(base, dist.Gamma):
        out = stats.gamma.ppf(q, _float(base.concentration), scale=1.0 / _float(base.rate))
    elif isinstance(base, dist.Weibull):
        out = stats.weibull_min.ppf(q, _float(base.concentration), scale=_float(base.scale))
    else:
        out = np.quantile(np.asarray(base.sample(jax.random.PRNGKey(0), (1 << 18,))), q)
    return jnp.asarray(out, jnp.result_type(float))


def _float(x):
    return float(np.asarray(x))


def _fisher_closed_form(base, group):
    if group == "affine":
        if isinstance(base, dist.StudentT):
            nu, s = _float(base.df), _float(base.scale)
            return (nu + 1) / ((nu + 3) * s * s), 2 * nu / (nu + 3)
        if isinstance(base, dist.Normal):
            return 1 / _float(base.scale) ** 2, 2.0
        if isinstance(base, dist.Cauchy):
            return 0.5 / _float(base.scale) ** 2, 0.5
        if isinstance(base, dist.Laplace):
            return 1 / _float(base.scale) ** 2, 1.0
        if isinstance(base, dist.Logistic):
            return 1 / (3 * _float(base.scale) ** 2), (math.pi**2 + 3) / 9
        return None
    if isinstance(base, Rayleigh):
        return None, 4.0
    if isinstance(base, dist.Weibull):
        return None, _float(base.concentration) ** 2
    if isinstance(base, dist.HalfNormal):
        return None, 2.0
    if isinstance(base, dist.Exponential):
        return None, 1.0
    if isinstance(base, dist.Gamma):
        return None, _float(base.concentration)
    if isinstance(base, dist.LogNormal):
        return None, 1 / _float(base.scale) ** 2
    return None


def _fisher_monte_carlo(base, group, n=1 << 16):
    x = base.sample(jax.random.PRNGKey(0), (n,))
    score = jax.vmap(jax.grad(lambda v: jnp.sum(base.log_prob(v))))(x)
    c_scale = float(jnp.mean((1.0 + x * score) ** 2))
    c_loc = float(jnp.mean(score**2)) if group == "affine" else None
    if group == "affine" and not (math.isfinite(c_loc) and c_loc > 0):
        # flat density (uniform): no location Fisher information; the Gaussian one of the same variance
        c_loc = 1.0 / float(jnp.var(x))
    return c_loc, c_scale


def fisher_metric(base, group):
    r"""The Fisher metric of the ``group``'s family at the identity, per coordinate: ``(c_loc, c_scale)``
    with :math:`c_b = \mathbb E_{q_0}[\psi^2]`, :math:`c_A = \mathbb E_{q_0}[(1 + \xi\psi)^2]`,
    :math:`\psi = (\log q_0)'` (``c_loc`` is None for the multiplicative group). Closed forms for
    Normal, StudentT, Cauchy, Laplace, Logistic (affine) and Rayleigh, Weibull, HalfNormal, Exponential,
    Gamma, LogNormal (multiplicative); a Monte Carlo estimate (:math:`2^{16}` draws, fixed key) otherwise,
    where a flat density (uniform) gets the location metric of the Gaussian of the same variance."""
    out = _fisher_closed_form(base, group)
    if out is None:
        out = _fisher_monte_carlo(base, group)
    for name, c in zip(("location", "scale"), out):
        if c is not None and not (math.isfinite(c) and c > 0):
            raise ValueError(
                f"the {name} Fisher metric of q0 = {type(base).__name__} is {c}: pass metric=(c_loc, c_scale) "
                "(positive numbers) or metric='identity'."
            )
    return out


def resolve_metric(metric, base, group):
    """``(c_loc, c_scale)`` from ``metric``: ``"fisher"`` (:func:`fisher_metric`), ``"identity"`` (1, 1:
    the reference code's choice, the metric folded into the step sizes) or a pair of positive numbers."""
    if isinstance(metric, str):
        if metric == "fisher":
            return fisher_metric(base, group)
        if metric == "identity":
            return (1.0 if group == "affine" else None), 1.0
        raise ValueError(f"metric must be 'fisher', 'identity' or (c_loc, c_scale), got {metric!r}.")
    try:
        c_loc, c_scale = (float(c) for c in metric)
    except Exception as err:  # noqa: BLE001
        raise ValueError(f"metric must be 'fisher', 'identity' or a pair (c_loc, c_scale), got {metric!r}.") from err
    if not all(math.isfinite(c) and c > 0 for c in (c_loc, c_scale)):
        raise ValueError(f"metric entries must be positive and finite, got {metric!r}.")
    return (c_loc if group == "affine" else None), c_scale


# ----------------------------------------------------------------------------- elementwise steps


def clamp_scale(scale):
    """A scale in ``[tiny, max]`` of its dtype: strictly positive and finite (NaN stays NaN: the step is skipped)."""
    info = jnp.finfo(scale.dtype)
    return jnp.clip(scale, info.tiny, info.max)


def clamp_log_scale(log_scale):
    """The same for a scale stored as its logarithm (the NumPyro guide's unconstrained parameter), with a factor 4
    of room at both ends: ``exp`` of it is a normal number (XLA on CPU flushes subnormals to 0) and a few
    products of it stay finite."""
    info = jnp.finfo(log_scale.dtype)
    return jnp.clip(log_scale, float(np.log(info.tiny * 4)), float(np.log(info.max / 4)))


def ema(momentum, x, beta):
    """:math:`\\beta M + (1-\\beta) x` (``x`` itself for :math:`\\beta = 0`)."""
    return beta * momentum + (1.0 - beta) * x if beta else x


class AdditiveRule(NamedTuple):
    """Options of the additive step (``optax.sgd``'s): every field is static."""

    lr: Any  # a float or a schedule count -> lr
    momentum: float = 0.0
    nesterov: bool = False


class MultiplicativeRule(NamedTuple):
    """Options of the multiplicative step: ``lr`` :math:`\\rho`, ``momentum`` :math:`\\beta`, ``metric`` :math:`c` and
    ``clip_radius`` :math:`r`, a bound on the exponent :math:`|z| \\le r` of one step (inf: none, as in the paper)."""

    lr: Any
    momentum: float = 0.0
    metric: float = 1.0
    clip_radius: float = float("inf")


class AffineRule(NamedTuple):
    """Options of the affine step: ``lr`` :math:`\\rho` (shift), ``scale_lr`` :math:`\\rho_A`, their momenta, the
    metric :math:`(c_b, c_A)`, ``clip_radius`` :math:`r`, a bound :math:`|z| \\le r` on the scale's exponent
    (inf: none, as in the paper; the shift uses the clipped :math:`z`, so the step is still an exponential map), and
    ``growth_radius`` :math:`r_g`, a tighter bound :math:`z \\ge -r_g` on the growing side (a scale grows by at most
    :math:`e^{r_g}` per step; inf: only :math:`r`)."""

    lr: Any
    scale_lr: Any
    momentum: float = 0.0
    scale_momentum: float = 0.0
    metric_loc: float = 1.0
    metric_scale: float = 2.0
    clip_radius: float = float("inf")
    growth_radius: float = float("inf")


class AffineGrad(NamedTuple):
    r"""The affine algebra gradient (natural units): ``loc`` :math:`X_b = A\,\mathbb E[G]`, ``scale``
    :math:`X_A = \mathbb E[A\epsilon G] - 1`."""

    loc: Any
    scale: Any


class MultiplicativeGrad(NamedTuple):
    r"""The multiplicative algebra gradient: ``scale`` :math:`X` shaped like the state's ``scale``
    (:math:`(X_+, X_-)` end to end in the signed form)."""

    scale: Any


def additive_delta(rule, trace, grad, count):
    """``(delta, trace)``: ``optax.sgd``'s update :math:`-\\rho t` and new trace from ``grad`` (any shape)."""
    lr = value_at(rule.lr, count)
    trace = grad + rule.momentum * trace if rule.momentum else grad
    direction = grad + rule.momentum * trace if rule.nesterov else trace
    return -lr * direction, trace


def additive_step(rule, loc, trace, grad, count):
    """``(loc, trace)`` after one ``optax.sgd`` step on ``grad`` (any shape)."""
    delta, trace = additive_delta(rule, trace, grad, count)
    return loc + delta.astype(loc.dtype), trace


def multiplicative_factor(rule, momentum, grad, count):
    """``(z, momentum)``: the new momentum and the exponent :math:`z = \\rho M` of :math:`g \\leftarrow g e^{-z}`."""
    momentum = ema(momentum, grad * (1.0 / rule.metric), rule.momentum)
    z = value_at(rule.lr, count) * momentum
    if rule.clip_radius != float("inf"):
        z = jnp.clip(z, -rule.clip_radius, rule.clip_radius)
    return z, momentum


def affine_direction(rule, scale, m_loc, m_scale, grad, count, with_decay=False):
    r"""``(z, shift, m_loc, m_scale)``: the new momenta, :math:`z = \rho_A M_A` (so :math:`A \leftarrow A e^{-z}`) and
    the shift :math:`-\rho A M_b \varphi(z)` (so :math:`b \leftarrow b + \text{shift}`), elementwise, any shape;
    with ``with_decay`` also :math:`e^{-z} - 1`."""
    m_loc = ema(m_loc, grad.loc * (1.0 / rule.metric_loc), rule.momentum)
    m_scale = ema(m_scale, grad.scale * (1.0 / rule.metric_scale), rule.scale_momentum)
    z = value_at(rule.scale_lr, count) * m_scale
    grow = min(rule.clip_radius, rule.growth_radius)  # finite whenever clip_radius is
    if grow != float("inf"):
        z = jnp.clip(z, -grow, rule.clip_radius)
    decay = jnp.expm1(-z)
    safe = jnp.where(z == 0, jnp.ones_like(z), z)
    phi_z = jnp.where(z == 0, jnp.ones_like(z), -decay / safe)  # phi(z), from the same expm1
    shift = -value_at(rule.lr, count) * scale * m_loc * phi_z
    return (z, shift, m_loc, m_scale, decay) if with_decay else (z, shift, m_loc, m_scale)


# ----------------------------------------------------------------------------- states
# The flat vectors of a state have ``layout.length`` entries: the weights, then from ``tree.PAD_FROM`` weights on a
# padding (tree.FlatLayout): zero weights, positive scales (the affine rule's initial scale, or 1 for a pytree of
# scales), which no loss reads. The multiplicative rule's state is not padded (init_multiplicative).


class AdditiveState(NamedTuple):
    r"""The additive group, :math:`\theta = w + \xi`: ``loc`` :math:`w` (flat), ``momentum`` (``optax.sgd``'s trace),
    ``count`` (steps taken), ``skipped`` (non-finite steps skipped), ``base_mean`` :math:`\mathbb E[\xi]`, ``layout``."""

    loc: jax.Array
    momentum: jax.Array
    count: jax.Array
    skipped: jax.Array
    base_mean: jax.Array
    layout: FlatLayout

    @property
    def params(self):
        """The point estimate :math:`\\mathbb E_q[\\theta] = w + \\mathbb E[\\xi]` as the weights' pytree."""
        return self.layout.to_params(self.loc + self.base_mean)

    def tree(self, flat):
        return self.layout.unravel(flat)


class MultiplicativeState(NamedTuple):
    r"""The multiplicative group: ``scale`` :math:`g` (flat), in the signed form :math:`(g_+, g_-)` end to end (twice
    the weights' size: one vector, so that a step is one pass), its ``momentum``, ``count``, ``skipped``,
    ``base_mean`` :math:`\mathbb E[\xi]`, ``layout``."""

    scale: jax.Array
    momentum: jax.Array
    count: jax.Array
    skipped: jax.Array
    base_mean: jax.Array
    layout: FlatLayout

    @property
    def signed(self):
        return self.scale.shape[0] != self.layout.length

    @property
    def params(self):
        r"""The point estimate :math:`\mathbb E_q[\theta] = \mathbb E[\xi](g_+ - g_-)` as the weights' pytree."""
        n = self.layout.length
        g = self.scale[:n] - self.scale[n:] if self.signed else self.scale
        return self.layout.to_params(self.base_mean * g)

    def tree(self, flat):
        return self.layout.unravel(flat)


class AffineState(NamedTuple):
    r"""The diagonal affine group, :math:`\theta = b + A\epsilon`: ``loc`` :math:`b`, ``scale`` :math:`A`, their momenta
    ``loc_momentum``, ``scale_momentum``, ``count``, ``skipped``, ``base_mean`` :math:`\mathbb E[\epsilon]`, ``layout``."""

    loc: jax.Array
    scale: jax.Array
    loc_momentum: jax.Array
    scale_momentum: jax.Array
    count: jax.Array
    skipped: jax.Array
    base_mean: jax.Array
    layout: FlatLayout

    @property
    def params(self):
        """The point estimate :math:`\\mathbb E_q[\\theta] = b + A\\,\\mathbb E[\\epsilon]` as the weights' pytree."""
        return self.layout.to_params(self.loc + self.scale * self.base_mean)

    def tree(self, flat):
        return self.layout.unravel(flat)


def _zero():
    return jnp.zeros((), jnp.int32)


def _leaf_values(tree, like, what, layout):
    """Flat values of ``tree`` (a number, or a pytree like ``like``) checked finite and > 0 per leaf, in ``layout`` (the
    state's, :func:`_flat_state`; a padding holds 1 or the number)."""
    if isinstance(tree, (int, float, np.number)) and not isinstance(tree, bool):
        if not (math.isfinite(float(tree)) and float(tree) > 0):
            raise ValueError(f"{what} must be positive and finite (a scale of q), got {tree!r}.")
        return jnp.full((layout.length,), float(tree), jnp.dtype(layout.dtype))
    if jax.tree.structure(tree) != jax.tree.structure(like):
        raise ValueError(f"{what} must be a positive number or a pytree like the parameters.")
    for path, leaf, ref in zip(
        (p for p, _ in jax.tree_util.tree_leaves_with_path(tree)), jax.tree.leaves(tree), jax.tree.leaves(like)
    ):
        leaf = np.asarray(leaf)
        where = jax.tree_util.keystr(path)
        if leaf.shape not in ((), np.shape(ref)):
            raise ValueError(f"{what} leaf {where} has shape {leaf.shape}, the parameter has {np.shape(ref)}.")
        bad = ~(np.isfinite(leaf) & (leaf > 0))
        if bad.any():
            raise ValueError(
                f"{what} leaf {where}: the initial scale must be strictly positive and finite, got "
                f"{leaf[bad].ravel()[:3].tolist()} ({int(bad.sum())} entries): the group keeps scales positive only "
                "if they start positive."
            )
    return layout.ravel(jax.tree.map(lambda s, p: jnp.broadcast_to(jnp.asarray(s, layout.dtype), jnp.shape(p)), tree, like),
                        fill=1.0)


def _flat_state(params, state_dtype, padded=True):
    """``(layout, flat params)`` in the state's dtype (:func:`numpyro_blr.tree.state_dtype`: float32 for bfloat16 or
    float16 parameters unless ``state_dtype`` says otherwise). The layout is padded (:class:`FlatLayout`: a network's
    flat vectors are whole parts for every CPU thread) unless ``padded`` is False."""
    from numpyro_blr.tree import state_dtype as _state_dtype

    layout = FlatLayout.of(params, padded=padded)
    return layout, layout.ravel(jax.tree.map(jnp.asarray, params)).astype(_state_dtype(layout.dtype, state_dtype))


def init_additive(params, base_mean_value=0.0, state_dtype=None):
    """A fresh :class:`AdditiveState` with :math:`\\mathbb E_q[\\theta]` = ``params`` (state in ``state_dtype``:
    :func:`numpyro_blr.tree.state_dtype`; the same for every ``init_*``)."""
    check_params(params)
    layout, mean = _flat_state(params, state_dtype)
    mu = jnp.asarray(base_mean_value, mean.dtype)
    return AdditiveState(mean - mu, jnp.zeros_like(mean), _zero(), _zero(), mu, layout)


def init_affine(params, scale_init, base_mean_value=0.0, state_dtype=None):
    """A fresh :class:`AffineState`: ``scale`` :math:`A_0` = ``scale_init`` (a number or a pytree like ``params``,
    strictly positive, checked per leaf) and :math:`b` such that :math:`\\mathbb E_q[\\theta]` = ``params``."""
    check_params(params)
    layout, mean = _flat_state(params, state_dtype)
    scale = _leaf_values(scale_init, params, "scale_init", layout).astype(mean.dtype)
    mu = jnp.asarray(base_mean_value, mean.dtype)
    zeros = jnp.zeros_like(mean)
    return AffineState(mean - scale * mu, scale, zeros, zeros, _zero(), _zero(), mu, layout)


def init_multiplicative(params, base_mean_value, signed, init_offset=1e-5, state_dtype=None):
    r"""A fresh :class:`MultiplicativeState` with :math:`\mathbb E_q[\theta]` = ``params``.

    Signed: :math:`g_\pm = \max(\pm w, 0)/\mathbb E[\xi] + o` (``init_offset`` :math:`o` > 0, which cancels in the
    mean): each weight starts excitatory or inhibitory by its sign. Unsigned: ``params`` must be
    :math:`\ge 0` (an error names the leaf otherwise) and :math:`g = w/\mathbb E[\xi] + o`."""
    check_params(params)
    if not (isinstance(init_offset, (int, float)) and math.isfinite(init_offset) and init_offset > 0):
        raise ValueError(f"init_offset must be a positive float (the scale given to zero weights), got {init_offset!r}.")
    if not signed:
        for path, leaf in jax.tree_util.tree_leaves_with_path(params):
            arr = np.asarray(leaf)
            if np.any(arr < 0):
                raise ValueError(
                    f"params leaf {jax.tree_util.keystr(path)} has {int(np.sum(arr < 0))} negative entries: the "
                    "multiplicative group theta = g * xi keeps weights positive, so a real-valued leaf needs the signed "
                    "form theta = g+ xi+ - g- xi- (signed=True), or the additive or affine group."
                )
    # not padded: its state is the weights twice (signed) or once (unsigned); with the padding its step ran 1.25x
    # slower on one thread (38.6-40.6 -> 50.4-50.9 ms at 1.9M weights, bench/bench_liegroup.py pinned), and on two
    # threads the signed state's even length gained nothing (docs/deep-learning.md, "Padded flat states")
    layout, w = _flat_state(params, state_dtype, padded=False)
    mu = jnp.asarray(base_mean_value, w.dtype)
    if signed:
        scale = jnp.concatenate([jnp.maximum(w, 0), jnp.maximum(-w, 0)]) / mu + init_offset
    else:
        scale = w / mu + init_offset
    return MultiplicativeState(scale, jnp.zeros_like(scale), _zero(), _zero(), mu, layout)


# ----------------------------------------------------------------------------- updates (skip a non-finite step)


def _counted(ok, state):
    return jnp.where(ok, state.count + 1, state.count), state.skipped + jnp.where(ok, 0, 1).astype(jnp.int32)


def additive_update(rule: AdditiveRule, state: AdditiveState, grad, loss=jnp.nan, check=None):
    """One additive step from the flat gradient :math:`\\hat G`; ``(state, StepInfo)``. A non-finite step is skipped
    (:func:`~numpyro_blr.core.skip_decision`; ``check`` is :attr:`~numpyro_blr.estimators.Estimate.check`)."""
    loc, trace = additive_step(rule, state.loc, state.momentum, grad, state.count)
    # a non-finite gradient makes the trace, hence loc, non-finite
    ok, entry = skip_decision(check, grad, loc)
    count, skipped = _counted(ok, state)
    loc, trace = select(entry, (loc, trace), (state.loc, state.momentum))
    return state._replace(loc=loc, momentum=trace, count=count, skipped=skipped), StepInfo(loss, ~ok)


def multiplicative_update(rule: MultiplicativeRule, state: MultiplicativeState, grad: MultiplicativeGrad, loss=jnp.nan,
                          check=None):
    """One multiplicative step from the algebra gradient; ``(state, StepInfo)``; skips as :func:`additive_update`."""
    z, mom = multiplicative_factor(rule, state.momentum, grad.scale, state.count)
    raw = state.scale * jnp.exp(-z) + (mom - mom)  # non-finite iff either is (x - x: 0 or NaN): one vector to check
    ok, entry = skip_decision(check, grad.scale, raw)
    scale, mom = select(entry, (clamp_scale(raw), mom), (state.scale, state.momentum))
    count, skipped = _counted(ok, state)
    return state._replace(scale=scale, momentum=mom, count=count, skipped=skipped), StepInfo(loss, ~ok)


def affine_update(rule: AffineRule, state: AffineState, grad: AffineGrad, loss=jnp.nan, check=None):
    """One affine step from the algebra gradient; ``(state, StepInfo)``; skips as :func:`additive_update`."""
    z, shift, m_loc, m_scale, decay = affine_direction(rule, state.scale, state.loc_momentum, state.scale_momentum, grad,
                                                       state.count, with_decay=True)
    # a non-finite m_loc makes the shift, hence loc, non-finite (A phi(z) > 0); + (m_scale - m_scale) (0 or NaN)
    # makes loc non-finite iff m_scale is too, so that the skip checks one vector
    loc = state.loc + shift + (m_scale - m_scale)
    scale = clamp_scale(state.scale + state.scale * decay)  # A e^{-z} = A + A expm1(-z): one transcendental
    ok, entry = skip_decision(check, grad, loc)
    old = (state.loc, state.scale, state.loc_momentum, state.scale_momentum)
    loc, scale, m_loc, m_scale = select(entry, (loc, scale, m_loc, m_scale), old)
    count, skipped = _counted(ok, state)
    new_state = state._replace(loc=loc, scale=scale, loc_momentum=m_loc, scale_momentum=m_scale, count=count, skipped=skipped)
    return new_state, StepInfo(loss, ~ok)


UPDATES = {"additive": additive_update, "multiplicative": multiplicative_update, "affine": affine_update}


# ----------------------------------------------------------------------------- the algorithm and its optax view


class LieParts(NamedTuple):
    """What a Lie-group row is made of (``Algorithm.parts``): the ``group``, its ``estimator`` (with ``draw`` and
    ``from_grads``), the ``rule`` options and ``init`` (params -> state)."""

    group: str
    estimator: Any
    rule: Any
    init: Any

    def as_optax(self, seed=0):
        return lie_as_optax(self, seed)

    def perturbed(self, params, opt_state):
        return lie_perturbed(self, params, opt_state)


def liegroup_algorithm(group, estimator, rule, init):
    r"""A Lie-group row as an :class:`~numpyro_blr.core.Algorithm`: ``step`` = ``estimator`` then the group's update.

    ``estimator(key, state, loss_fn, *batch) -> Estimate`` whose ``grad`` is the algebra gradient
    (:mod:`numpyro_blr.estimators.liegroup`), with ``estimator.draw(key, state) -> (theta, noise)`` (flat)."""
    from numpyro_blr.core import Algorithm

    if group not in GROUPS:
        raise ValueError(f"group must be one of {GROUPS}, got {group!r}.")
    apply = UPDATES[group]

    def update(state, estimate):
        return apply(rule, state, estimate.grad, estimate.loss, estimate.check)

    def step(key, state, loss_fn, *batch):
        return update(state, estimator(key, state, loss_fn, *batch))

    def sample(key, state, n):
        """``n`` draws of the weights (pytree, leading axis ``n``); draw ``s`` uses ``jax.random.split(key, n)[s]``."""
        thetas = jax.vmap(lambda k: estimator.draw(k, state)[0])(jax.random.split(key, n))
        return state.layout.to_params(thetas)

    return Algorithm(init=init, step=step, sample=sample, update=update, parts=LieParts(group, estimator, rule, init))


class LieTransformState(NamedTuple):
    """State of a Lie-group row's optax view: the row's state (its location is the caller's ``params``) and the key
    of the current draw (:func:`numpyro_blr.perturbed`)."""

    state: Any
    key: jax.Array


def _with_params(parts, state, params):
    """The row's state with its location read from the caller's ``params`` (additive, affine)."""
    if params is None or parts.group == "multiplicative":
        return state
    mean = state.layout.ravel(params).astype(state.loc.dtype)
    if parts.group == "additive":
        return state._replace(loc=mean - state.base_mean)
    return state._replace(loc=mean - state.scale * state.base_mean)


def lie_perturbed(parts, params, opt_state):
    r"""The weights at which to evaluate the gradient for the next ``update`` of the view: a draw
    :math:`\theta = g\cdot\xi` from the key in ``opt_state``. For the additive and affine groups the location
    is the caller's ``params``; for the multiplicative group :math:`g_\pm` live in the view's state (``params``
    follow its point estimate)."""
    state = _with_params(parts, opt_state.state, params)
    theta, _ = parts.estimator.draw(opt_state.key, state)
    return state.layout.to_params(theta)


def lie_as_optax(parts, seed=0):
    """A Lie-group row as an ``optax.GradientTransformationExtraArgs`` (see :func:`numpyro_blr.as_optax`): the
    updates move ``params`` to the row's new point estimate."""
    import optax

    apply = UPDATES[parts.group]

    def init(params):
        return LieTransformState(parts.init(params), jax.random.key(seed))

    def update(grads, opt_state, params=None, **extra):
        if params is None:
            raise ValueError("the Lie-group BLR's optax view needs params: call tx.update(grads, opt_state, params).")
        if extra:
            raise ValueError(f"the Lie-group rows take no extra arguments, got {sorted(extra)}.")
        state = _with_params(parts, opt_state.state, params)
        layout = state.layout
        _, noise = parts.estimator.draw(opt_state.key, state)
        estimate = parts.estimator.from_grads(state, layout.ravel(grads), noise)
        new, _ = apply(parts.rule, state, estimate.grad, estimate.loss, finite_check(grads))
        if parts.group == "additive":  # the step itself, so that the view is optax.sgd to the last bit
            step, _ = additive_delta(parts.rule, state.momentum, estimate.grad, state.count)
            delta = jnp.where(new.count > state.count, step, jnp.zeros_like(step))
        elif parts.group == "affine":
            delta = (new.loc - state.loc) + (new.scale - state.scale) * state.base_mean
        else:
            delta = layout.ravel(new.params).astype(new.scale.dtype) - layout.ravel(params).astype(new.scale.dtype)
        key, _ = jax.random.split(opt_state.key)
        return layout.to_params(delta), LieTransformState(new, key)

    return optax.GradientTransformationExtraArgs(init, update)

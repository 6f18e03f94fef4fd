r"""The Lie-group BLR in NumPyro: :class:`LieGroupGuide` over a model's latent sites and :class:`LieGroupBLR`,
its optimizer::

    guide = nb.LieGroupGuide(model)  # affine group, Gaussian q0; positive sites lognormal
    svi = SVI(model, guide, nb.LieGroupBLR(), Trace_ELBO())  # the adaptive default: no lr to choose

Each latent site's guide is the push-forward of a base distribution :math:`q_0` (any reparameterisable
univariate NumPyro distribution) by a group element, elementwise (Kiral, Moellenhoff & Khan 2023;
:mod:`numpyro_blr.rules.liegroup`):

==========================  ======================================  ===========================================
site                        group                                   guide parameters (``{site}_{prefix}_...``)
==========================  ======================================  ===========================================
positive support, defaults  affine on :math:`\log\theta` (lognormal) ``loc`` :math:`b`, ``scale`` :math:`A`
positive support, with      multiplicative: :math:`\theta = g\xi`,  ``scale`` :math:`g` (no softplus, no exp of a
``positive_base`` (*)       :math:`\xi \sim` ``positive_base``      Gaussian: :math:`\theta` itself is drawn)
any other continuous        affine: :math:`T(b + A\epsilon)`        ``loc`` :math:`b`, ``scale`` :math:`A`
                            additive: :math:`T(b + \xi)`            ``loc`` :math:`b`
==========================  ======================================  ===========================================

(*) or with ``group="additive"``, or a non-Gaussian ``base`` (whose exponential can lack the moments a likelihood needs).
The one-parameter multiplicative family has the fixed spread of :math:`q_0` (``Gamma(10)``: coefficient of variation
0.32), so it cannot fit a well-determined scale (``docs/lie-group.md``); the default on positive sites is the affine
group acting on :math:`\log\theta`, whose shift is the multiplicative group's map on the median :math:`e^b`.
:math:`T` = ``biject_to(support)`` (the identity on real sites), as in ``AutoNormal``. ``group`` is the group of
the non-positive sites (``"affine"`` or ``"additive"``); ``groups={site: group}`` overrides it per site
(``"affine"`` on a positive site acts on :math:`\log\theta`). The multiplicative group on a real site would need
the signed form :math:`g_+\xi_+ - g_-\xi_-`, whose density has no closed form (the ELBO needs
:math:`\log q`): it is refused with that reason (use it for network weights, ``nb.lie_multiplicative``).
Scales are ``constraints.positive`` parameters (stored as logarithms by NumPyro), so the exponential map
:math:`A \leftarrow A e^{-z}` is a shift of the stored value.

**The optimizer.** SVI's loss is :math:`L = \mathbb E_q[-\log p(\mathcal D, \theta)] - \mathbb H[q]` (one draw
per particle, the key fixed within a step), so its gradients *are* the algebra gradients of
:mod:`numpyro_blr.rules.liegroup` in natural units (:math:`N = T = 1`): for a stored log-scale,
:math:`\partial L/\partial\log A = \mathbb E[A\epsilon\nabla U] - 1 = X_A` and
:math:`\partial L/\partial\log g = \mathbb E[g\xi\nabla U] - 1 = X`; for the shift,
:math:`X_b = A\,\partial L/\partial b`. :class:`LieGroupBLR` applies the group's exponential-map step to them
with the Fisher metric of each site's :math:`q_0` (a :class:`~numpyro_blr.svi.GuideOptimizer`: parameters
outside the guide go to ``fallback``, non-finite steps are skipped and reported). Its defaults are ``nb.BLR()``'s:
the adaptive step size with iterate averaging, a dense Newton step for the shifts, backtracking, and the end-of-run
report (:class:`LieGroupBLR`), and, with the dense step, the shifts' gradient and Hessian averaged over the step's
draw and 8 more (``curvature_draws``: one draw's curvature of a log-scale is too heavy-tailed for the exponential
map). With a Gaussian :math:`q_0`
the affine step is, to first order in ``lr``, ``nb.BLR``'s diagonal step with the same ``lr``.

``Predictive``, ``guide.sample_posterior``, ``median``, ``quantiles`` and ``nb.diagnostics.to_datatree`` work
on the fitted parameters (the guide is an ``AutoGuide``; its sites have densities, so ``log q`` and Pareto
k-hat are available).
"""

import math
import weakref
from contextlib import ExitStack
from dataclasses import dataclass
from typing import NamedTuple, Optional

import numpy as np
import jax
import jax.numpy as jnp
import numpyro
import numpyro.distributions as dist
from jax import lax
from numpyro.distributions import constraints
from numpyro.distributions.transforms import AffineTransform, biject_to
from numpyro.infer.autoguide import AutoGuide
from numpyro.infer.initialization import init_to_uniform
from numpyro.distributions.util import periodic_repeat
from numpyro.optim import _value_and_grad

from numpyro_blr.compile_once import transformed_with_intermediates
from numpyro_blr.estimators.svi import (loss_gradients_and_products, hutchinson_diagonal, probe_directions,
                                         probe_product)
from numpyro_blr.families.registry import base_support
from numpyro_blr.layout import GuideLayoutError, Layout
from numpyro_blr.rules import liegroup as lie
from numpyro_blr.core import backtracking_factor, value_at
from numpyro_blr.report import (CLIP_SDS, DAMPED_FRACTION, MIN_STEPS, MOVED_SDS,
                                 STILL_FALLING_ALONE_NATS, STILL_FALLING_MIN, STILL_FALLING_SES, FitTrace, _is_falling,
                                 collapsed_sd, empty_loss_blocks, evidence_report, is_block_end, next_trace)
from numpyro_blr.rules.schedules import adaptive_decay
from numpyro_blr.svi import GuideAlgorithm, GuideOptimizer, GuideStep

GUIDE_GROUPS = ("affine", "additive", "multiplicative")
_GUIDES = weakref.WeakSet()  # live LieGroupGuides: LieGroupBLR finds its guide among them by parameter names


class _DrawOnce(dist.TransformedDistribution):
    """``TransformedDistribution`` whose base draw is computed once, behind ``lax.optimization_barrier``, and read
    by every transform and log-density term after it. Without the barrier XLA's fusion copies the draw (for a
    Gaussian :math:`q_0`, threefry bits and float64 ``erf_inv``: about 240 operations per value) into each fused
    consumer: ``nb.LieGroupBLR``'s 15-step program on a four-site regression held 51,529 operations, 22,034 of
    them ``erf_inv``, and took 3.4 s to compile at XLA's -O0 (``tests/workflow/test_fit.py``'s model)."""

    def sample(self, key, sample_shape=()):
        return self.sample_with_intermediates(key, sample_shape)[0]

    def sample_with_intermediates(self, key, sample_shape=()):
        x = lax.optimization_barrier(self.base_dist(rng_key=key, sample_shape=sample_shape))
        return transformed_with_intermediates(x, self.transforms)


def _act(group, values, xi):
    r"""The group element (the site's ``values``) applied to :math:`\xi`: :math:`b + A\xi`, :math:`b + \xi` or :math:`g\xi`."""
    if group == "affine":
        return values["loc"] + values["scale"] * xi
    if group == "additive":
        return values["loc"] + xi
    return values["scale"] * xi


class LieGroupGuide(AutoGuide):
    r"""A mean-field guide whose sites are push-forwards of a base distribution by a Lie group (module docstring).

    :param model: the NumPyro model.
    :param group: the group of sites without positive support: ``"affine"`` (default) or ``"additive"``
        (``"multiplicative"`` fits positive sites only, and raises naming any other site).
    :param base: :math:`q_0` of the affine and additive sites (default ``dist.Normal(0, 1)``), a reparameterisable
        univariate NumPyro distribution with scalar parameters (``dist.StudentT(3.0)``, ``dist.Laplace()``, ...).
        For the additive group it is the fixed noise (its scale is the guide's spread).
    :param positive_base: :math:`q_0` of the multiplicative (positive) sites, positive (default
        :class:`~numpyro_blr.rules.liegroup.Rayleigh` (1); the shape of :math:`\theta/\mathbb E\theta` is
        :math:`q_0`'s: ``dist.Gamma(k)`` gives coefficient of variation :math:`1/\sqrt k`).
    :param groups: ``{site: group}`` overrides.
    :param init_loc_fn: where the sites' means start (default ``init_to_uniform``, as NumPyro's Gaussian
        autoguides). ``init_to_median`` can be slow: on a latent random walk whose scale has a small prior median (the
        robustness suite's ``stochastic_volatility``) a small walk scale and small scales of the walk's values hold
        each other there, and 1,000 steps from it ended 1.3 nats short in float32, as did ``nb.BLR()`` +
        ``AutoNormal(init_loc_fn=init_to_median)``; from ``init_to_uniform`` both end at the optimum
        (docs/lie-group.md).
    :param init_scale: the initial standard deviation of the affine sites (unconstrained), a float or
        ``{site: float}``, strictly positive: :math:`A_0` = ``init_scale`` / sd(:math:`q_0`) (or ``init_scale``
        when :math:`q_0` has no finite variance).
    :param metric: the natural-gradient metric: ``"fisher"`` (default: :math:`q_0`'s Fisher information,
        :func:`~numpyro_blr.rules.liegroup.fisher_metric`), ``"identity"`` or ``(c_loc, c_scale)``.
    :param prefix: parameter names are ``{site}_{prefix}_loc`` / ``{site}_{prefix}_scale``.
    """

    def __init__(self, model, *, group="affine", base=None, positive_base=None, groups=None, init_loc_fn=init_to_uniform,
                 init_scale=0.1, metric="fisher", prefix="lie", create_plates=None):
        if group not in GUIDE_GROUPS:
            raise ValueError(f"group must be one of {GUIDE_GROUPS}, got {group!r}.")
        groups = dict(groups or {})
        for site, g in groups.items():
            if g not in GUIDE_GROUPS:
                raise ValueError(f"groups[{site!r}] = {g!r} is not one of {GUIDE_GROUPS}.")
        self.group = group
        self.groups = groups
        self.base = dist.Normal(0.0, 1.0) if base is None else base
        self.positive_base = dist.Gamma(10.0) if positive_base is None else positive_base
        # positive sites: with the affine group and a Gaussian q0 (the defaults), the affine group on log(theta), the
        # lognormal family of AutoNormal (a free spread); the one-parameter multiplicative family theta = g * xi, whose
        # spread is that of xi, when a positive q0 is given, with another group, or with another q0 (exp of a
        # Student-t draw has no moments of theta^-2, so a Gaussian likelihood's scale would have an infinite ELBO)
        self.positive_multiplicative = (positive_base is not None or group != "affine"
                                        or type(self.base) is not dist.Normal)
        if isinstance(init_scale, dict):
            for site, s in init_scale.items():
                self._check_init_scale(s, site)
        else:
            self._check_init_scale(init_scale, None)
        self.init_scale = init_scale
        self.metric = metric
        self._sites = None
        super().__init__(model, prefix=prefix, init_loc_fn=init_loc_fn, create_plates=create_plates)
        _GUIDES.add(self)

    @staticmethod
    def _check_init_scale(s, site):
        where = f"init_scale[{site!r}]" if site is not None else "init_scale"
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s <= 0:
            raise ValueError(
                f"{where} must be a strictly positive finite float (the initial scale of "
                f"{'site ' + repr(site) if site is not None else 'every affine site'}), got {s!r}: the group keeps "
                "scales positive only if they start positive."
            )

    # -- setup -------------------------------------------------------------------------------
    def _site_group(self, name, site):
        support = site["fn"].support
        positive = lie.is_positive_support(support)
        if name in self.groups:
            group = self.groups[name]
        elif positive:
            group = "multiplicative" if self.positive_multiplicative else "affine"
        else:
            group = self.group
        if group == "multiplicative" and not positive:
            raise ValueError(
                f"LieGroupGuide: site {name!r} has support {support}: the multiplicative group theta = g * xi keeps "
                "values positive, so a real-valued site would need the signed form theta = g+ xi+ - g- xi-, whose "
                "density has no closed form (the ELBO needs log q); LieGroupGuide does not offer it. Use "
                f"groups={{{name!r}: 'affine'}} for this site (or nb.lie_multiplicative(signed=True) for network weights)."
            )
        return group

    def _setup_prototype(self, *args, **kwargs):
        super()._setup_prototype(*args, **kwargs)
        unknown = set(self.groups) - {n for n, s in self.prototype_trace.items() if s["type"] == "sample" and not s["is_observed"]}
        if unknown:
            raise ValueError(f"groups names site(s) {sorted(unknown)} that are not latent sample sites of the model.")
        if isinstance(self.init_scale, dict):
            unknown = set(self.init_scale) - set(self._init_locs)
            if unknown:
                raise ValueError(f"init_scale names site(s) {sorted(unknown)} that are not latent sample sites of the model.")
        self._sites = {}
        for name, site in self.prototype_trace.items():
            if site["type"] != "sample" or site["is_observed"]:
                continue
            if site["fn"].support.is_discrete:
                raise ValueError(f"LieGroupGuide: site {name!r} is discrete ({site['fn'].support}): the groups act on "
                                 "continuous values; marginalise it out of the model.")
            group = self._site_group(name, site)
            base = self.positive_base if group == "multiplicative" else self.base
            where = f"LieGroupGuide: site {name!r} (q0 of the {group} group)"
            lie.check_base(base, where, group)
            c_loc, c_scale = (None, None) if group == "additive" else lie.resolve_metric(self.metric, base, group)
            init_loc = self._init_locs[name]
            event_dim = site["fn"].event_dim + jnp.ndim(init_loc) - jnp.ndim(site["value"])
            for frame in site["cond_indep_stack"]:  # subsampled plates: parameters for the full size (as AutoNormal)
                full_size = self._prototype_frame_full_sizes[frame.name]
                if full_size != frame.size:
                    init_loc = periodic_repeat(init_loc, full_size, frame.dim - event_dim)
            self._init_locs[name] = init_loc
            mu = lie.base_mean(base)
            dtype = jnp.result_type(init_loc)
            if group == "affine":
                s = self.init_scale.get(name, 0.1) if isinstance(self.init_scale, dict) else self.init_scale
                try:
                    sd0 = math.sqrt(float(base.variance))
                except Exception:  # noqa: BLE001
                    sd0 = float("nan")
                a0 = s / sd0 if math.isfinite(sd0) and sd0 > 0 else s
                scale = jnp.full(jnp.shape(init_loc), a0, dtype)
                init = {"loc": init_loc - scale * mu, "scale": scale}
            elif group == "additive":
                init = {"loc": init_loc - mu}
            else:  # positive site: E[theta] = exp(init_loc) at the start
                init = {"scale": jnp.exp(init_loc) / mu}
            self._sites[name] = dict(group=group, base=base, event_dim=event_dim, support=site["fn"].support,
                                     metric=(c_loc, c_scale), init=init, frames=site["cond_indep_stack"])

    # -- distributions -------------------------------------------------------------------------
    def _param_name(self, site, p):
        return f"{site}_{self.prefix}_{p}"

    def param_names(self):
        """The guide's parameter names (after its first call)."""
        self._check()
        return {self._param_name(n, p) for n, info in self._sites.items() for p in info["init"]}

    def _latent_dist(self, name, values):
        """The distribution of the site's unconstrained value (of :math:`\\theta` itself for multiplicative sites)."""
        info = self._sites[name]
        group, event_dim = info["group"], info["event_dim"]
        ref = values["scale"] if group != "additive" else values["loc"]
        base = info["base"].expand(jnp.shape(ref))
        base = base.to_event(event_dim) if event_dim else base
        if group == "affine":
            return _DrawOnce(base, AffineTransform(values["loc"], values["scale"]))
        if group == "additive":
            return _DrawOnce(base, AffineTransform(values["loc"], jnp.ones((), ref.dtype)))
        return _DrawOnce(base, AffineTransform(jnp.zeros((), ref.dtype), values["scale"], domain=constraints.positive))

    def _site_dist(self, name, values):
        """The guide distribution of the site's value (in its support)."""
        info = self._sites[name]
        d = self._latent_dist(name, values)
        if info["group"] == "multiplicative" or base_support(info["support"]) is constraints.real:
            return d
        return _DrawOnce(d.base_dist, d.transforms + [biject_to(info["support"])])

    def __call__(self, *args, **kwargs):
        if self.prototype_trace is None:
            self._setup_prototype(*args, **kwargs)
        plates = self._create_plates(*args, **kwargs)
        result = {}
        for name, info in self._sites.items():
            with ExitStack() as stack:
                for frame in info["frames"]:
                    stack.enter_context(plates[frame.name])
                values = {}
                for p, init in info["init"].items():
                    constraint = constraints.positive if p == "scale" else constraints.real
                    values[p] = numpyro.param(self._param_name(name, p), init, constraint=constraint,
                                              event_dim=info["event_dim"])
                result[name] = numpyro.sample(name, self._site_dist(name, values))
        return result

    # -- after the fit ---------------------------------------------------------------------------
    def _check(self):
        if self._sites is None:
            raise RuntimeError("LieGroupGuide has not been set up: run SVI (or call the guide once) first.")

    def _values(self, name, params):
        return {p: params[self._param_name(name, p)] for p in self._sites[name]["init"]}

    def get_posterior(self, params):
        """``{site: numpyro distribution}`` of each site's value under the fitted guide."""
        self._check()
        return {name: self._site_dist(name, self._values(name, params)) for name in self._sites}

    def _to_unconstrained(self, name, x):
        return jnp.log(x) if self._sites[name]["group"] == "multiplicative" else x

    def _constrain(self, latent):
        """Constrained site values and deterministic sites from unconstrained ``latent`` (as ``AutoNormal``)."""
        name = next(iter(latent))
        sample_shape = jnp.shape(latent[name])[: jnp.ndim(latent[name]) - jnp.ndim(self._init_locs[name])]
        if sample_shape:
            flat = jax.tree.map(lambda x: jnp.reshape(x, (-1,) + jnp.shape(x)[len(sample_shape):]), latent)
            out = lax.map(self._postprocess_fn, flat)
            return jax.tree.map(lambda x: jnp.reshape(x, sample_shape + jnp.shape(x)[1:]), out)
        return self._postprocess_fn(latent)

    def sample_posterior(self, rng_key, params, *args, sample_shape=(), **kwargs):
        """Draws ``{site: sample_shape + site shape}`` (and the model's deterministic sites) from the guide."""
        self._check()
        keys = jax.random.split(rng_key, len(self._sites))
        latent = {}
        for key, name in zip(keys, self._sites):
            x = self._latent_dist(name, self._values(name, params)).sample(key, tuple(sample_shape))
            latent[name] = self._to_unconstrained(name, x)
        return self._constrain(latent)

    def quantiles(self, params, quantiles):
        """Quantiles of each site (``len(quantiles)`` leading axis): :math:`T(b + A\\,F_0^{-1}(q))`,
        :math:`g F_0^{-1}(q)`, from :math:`q_0`'s inverse CDF (sites are monotone in :math:`\\xi`)."""
        self._check()
        q = jnp.asarray(quantiles)
        latent = {}
        for name, info in self._sites.items():
            v = self._values(name, params)
            ref = v["scale"] if info["group"] != "additive" else v["loc"]
            z = lie.base_quantile(info["base"], q).reshape((-1,) + (1,) * jnp.ndim(ref))
            latent[name] = self._to_unconstrained(name, _act(info["group"], v, z))
        return self._constrain(latent)

    def median(self, params):
        """The median of each site (:meth:`quantiles` at 0.5)."""
        return {k: v[0] for k, v in self.quantiles(params, [0.5]).items()}

    def mean(self, params):
        """:math:`\\mathbb E_q[\\theta]` of the multiplicative sites and :math:`T(\\mathbb E_q[u])` of the others."""
        self._check()
        latent = {}
        for name, info in self._sites.items():
            mu = lie.base_mean(info["base"])
            latent[name] = self._to_unconstrained(name, _act(info["group"], self._values(name, params), mu))
        return self._constrain(latent)

    def blocks(self, params):
        """The :class:`LieBlock` of every site whose parameters are in ``params``."""
        self._check()
        out = []
        for name, info in self._sites.items():
            names = {p: self._param_name(name, p) for p in info["init"]}
            if not all(n in params for n in names.values()):
                continue
            c_loc, c_scale = info["metric"]
            handle = names.get("loc", names.get("scale"))
            out.append(LieBlock(f"lie-{info['group']}", handle, name, info["group"], names.get("loc"),
                                names.get("scale"), c_loc, c_scale, _base_sd(info["base"]),
                                type(info["base"]) is dist.Normal))
        return tuple(out)


@dataclass(frozen=True)
class LieBlock:
    """One site of a :class:`LieGroupGuide` as :class:`LieGroupBLR` reads it: its group, parameter names (``loc``:
    a handle, the shift's name or else the scale's) and the Fisher metric of its :math:`q_0`."""

    kind: str
    loc: str
    site: str
    group: str
    loc_param: Optional[str]
    scale_param: Optional[str]
    metric_loc: Optional[float]
    metric_scale: Optional[float]
    base_sd: float = 1.0  # sd of q0: the whitened mean gradient is A dL/db times it
    gaussian: bool = False  # q0 is a Normal: the dense Newton step generalises the Fisher metric A^-2 (joint_shift)


# ----------------------------------------------------------------------------- the optimizer


DEFAULT_LR = (0.5, 10.0)  # adaptive_decay(init_value, halving_steps): nb.BLR()'s default schedule
CURVATURE_DRAWS = 8  # extra draws of the joint mean step's gradient and Hessian (LieGroupBLR(curvature_draws=...))
# an affine scale grows by at most sqrt(2) per step (LieGroupBLR(growth_radius=...)): the bound of nb.BLR's one-sided
# precision step, whose precision k(b) = b + (1 - b)^2 / 2 >= 1/2 of the last one at any curvature
GROWTH_RADIUS = 0.5 * math.log(2.0)
BACKTRACK_TRIES = 8
# The report's drift: a loss falling by STILL_FALLING_SES standard errors and DRIFT_NATS nats while a returned location
# moved DRIFT_SDS sds since the last block began is reported below STILL_FALLING_NATS too (float32 stochastic volatility:
# 1.33 +- 0.36 nats, the walk's scale 4.3 sd, 1.5 nats short of the mean-field optimum after 1,000 steps); a converged
# centred eight schools read 0.35 +- 0.09 nats with a location 2 sds off its snapshot (the funnel).
DRIFT_SDS = 2.0
DRIFT_NATS = 0.75
JOINT_MAX_DIM = 256  # the joint mean step (a dense Hessian per step) up to this many shift coordinates, as nb.BLR


class LieSVIState(NamedTuple):
    r""":class:`LieGroupBLR`'s state over the guide's parameters (fixed-shape arrays: ``SVI.run`` scans and resumes it).

    ``momentum``  per parameter, the momentum of its algebra gradient (``optax.sgd``'s trace for additive shifts);
    ``count``     steps taken;
    ``trace``     :class:`~numpyro_blr.report.FitTrace`, the evidence of the end-of-run report and the clock of the
                  adaptive step size (as ``nb.BLR``'s);
    ``average``   with the default step size: the average of the iterates of every guide parameter, in the stored
                  (exponential) coordinates :math:`b`, :math:`\log A`, :math:`\log g`, which ``get_params``
                  returns; else empty;
    ``mean_scale_tril`` with the joint mean step: the lower Cholesky factor :math:`L` of :math:`P^{-1}`, the inverse
                  of the dense precision across the shifts (as ``nb.BLR``'s ``mean_scale_tril``), ``(0, 0)`` otherwise;
    ``draws_on``  whether the joint step averages over extra draws (``curvature_draws``): set once a step's sampled
                  Hessian had a negative diagonal entry, read from the next step on;
    ``snapshot``  every guide parameter as ``get_params`` returns it (the average, with averaging) when the trace's
                  last block of losses began: the report names the sites that moved most since then when the loss
                  still falls (:func:`liegroup_fit_report`).
    """

    momentum: dict
    count: jax.Array
    trace: FitTrace
    average: dict
    mean_scale_tril: jax.Array
    draws_on: jax.Array
    snapshot: dict = None


def _find_guide(params, optimizer):
    guide = optimizer.guide
    if isinstance(guide, LieGroupGuide):
        return guide
    keys = set(params)
    found = [g for g in list(_GUIDES) if g._sites is not None and g.param_names() and g.param_names() <= keys]
    most = max((len(g.param_names()) for g in found), default=0)
    found = [g for g in found if len(g.param_names()) == most]  # the guide covering the most parameters
    specs = {g.blocks(params) for g in found}
    if not found:
        raise GuideLayoutError(
            f"LieGroupBLR reads a nb.LieGroupGuide's parameters ('<site>_lie_loc' / '<site>_lie_scale'); none of the "
            f"live LieGroupGuides has its parameters among {sorted(params)}. Use nb.LieGroupGuide(model, ...) as the "
            "guide, or pass it: nb.LieGroupBLR(lr, guide=guide)."
        )
    if len(specs) > 1:
        raise GuideLayoutError(
            "LieGroupBLR found several LieGroupGuides with these parameter names but different groups or bases; pass "
            "the one being fitted: nb.LieGroupBLR(lr, guide=guide)."
        )
    return found[0]


def _base_sd(base):
    try:
        sd = math.sqrt(float(base.variance))
    except Exception:  # noqa: BLE001
        return 1.0
    return sd if math.isfinite(sd) and sd > 0 else 1.0


def _names(b):
    return [n for n in (b.loc_param, b.scale_param) if n is not None]


def _backtrack(fn, params, delta, loss, control=None, shrink=0.25, tries=BACKTRACK_TRIES, draws=None):
    r"""Damping :math:`\alpha` of the shifts ``delta`` (``{loc name: step}``): the first of :math:`1, 1/4, 1/16, \dots`
    at which this step's sample of the loss (the draw fixed) does not rise, 0 when none of ``tries`` does.

    With the draw :math:`\epsilon` fixed, the loss is :math:`f(b) = -\log p(\mathcal D, T(b + A\epsilon)) + \log q`
    and the shift :math:`-\rho A M_b\varphi(z)` (without momentum) is :math:`-\rho A^2\varphi(z)\nabla f`: a descent
    direction of :math:`f`, so some :math:`\alpha > 0` is accepted. The damped step is the group's exponential map
    with the shift's step size :math:`\alpha\rho` (the scale's :math:`z` unchanged). On a quadratic loss at the
    fixed point, :math:`\alpha` is even in :math:`\epsilon` for a symmetric :math:`q_0`, so the fixed point is
    unchanged; where the diagonal step overshoots (a strongly correlated posterior, on which the mean step is a
    Jacobi iteration with eigenvalues :math:`\rho\lambda > 2`; a far start on saturating logits) it stops the means
    from oscillating out. With the joint step's control variate :math:`c` (``control``, ``{loc name: c}``), the step
    is a Newton step on :math:`\phi(b') = f(b') - (b' - b)^\top c`, whose expectation is :math:`f`'s, and
    :math:`\phi` is compared (``nb.BLR._backtrack``). One loss evaluation per try (Nocedal & Wright 2006, Sec. 3.1).

    With the joint step's extra draws (``draws``: ``(layout, offsets, weights)``, :func:`extra_draws`) the shift is a
    Newton step on the average of the sampled losses :math:`\bar f(b') = (f(b') + \sum_j w_j U(b' + z_j - b)) /
    (1 + \sum_j w_j)` (the draws move with the shift), and :math:`\bar f - (b' - b)^\top c` is compared: one
    vectorised evaluation of the :math:`1 + k` losses per try."""
    loss0 = jnp.asarray(loss)
    control = control or {}
    slope = sum((jnp.sum(delta[n] * c).astype(loss0.dtype) for n, c in control.items()), jnp.zeros((), loss0.dtype))
    extra, count = (lambda alpha: 0.0), jnp.ones((), loss0.dtype)
    if draws is not None:
        layout, offsets, weights = draws
        blocks = _shift_blocks(layout)
        shapes = [jnp.shape(params[b.loc_param]) for b in blocks]
        flat_b = jnp.concatenate([params[b.loc_param].reshape(-1) for b in blocks])
        flat_d = jnp.concatenate([jnp.broadcast_to(delta.get(b.loc_param, 0.0), sh).reshape(-1) for b, sh in zip(blocks, shapes)])
        weights = weights.astype(loss0.dtype)
        count = 1.0 + jnp.sum(weights)

        def at(flat):
            points, start = {}, 0
            for b, sh in zip(blocks, shapes):
                n = int(np.prod(sh))
                points[b.loc_param] = flat[start:start + n].reshape(sh).astype(params[b.loc_param].dtype)
                start += n
            return jnp.asarray(fn(_at_points(params, layout, points))[0], loss0.dtype)

        def extra(alpha):
            def evaluate(_):
                vals = jax.vmap(at)(flat_b[None, :] + offsets + alpha.astype(flat_b.dtype) * flat_d[None, :])
                return jnp.sum(jnp.where(weights > 0, weights * vals, 0.0))

            return lax.cond(jnp.any(weights > 0), evaluate, lambda _: jnp.zeros((), loss0.dtype), None)

        loss0 = (loss0 + extra(jnp.zeros((), loss0.dtype))) / count

    def value(alpha):
        p = dict(params)
        for n, d in delta.items():
            p[n] = params[n] + alpha.astype(params[n].dtype) * d
        return (jnp.asarray(fn(p)[0], loss0.dtype) + extra(alpha)) / count - alpha * slope

    return backtracking_factor(value, loss0, shrink, tries)


def _shift_blocks(layout):
    return [b for b in layout.blocks if b.group in ("affine", "additive")]


def _shift_size(params, layout):
    return sum(int(np.prod(jnp.shape(params[b.loc_param]))) for b in _shift_blocks(layout))


def _flat_shift_loss(fn, params, layout):
    """``(loss_of, flat0)``: this step's loss (the draw fixed) as a function of the affine and additive sites' locs
    flattened into one vector, and that vector now."""
    blocks = _shift_blocks(layout)
    shapes = [jnp.shape(params[b.loc_param]) for b in blocks]
    sizes = [int(np.prod(sh)) for sh in shapes]
    flat0 = jnp.concatenate([params[b.loc_param].reshape(-1) for b in blocks])

    def loss_of(flat):
        p, start = dict(params), 0
        for b, sh, n in zip(blocks, shapes, sizes):
            p[b.loc_param] = flat[start:start + n].reshape(sh).astype(params[b.loc_param].dtype)
            start += n
        return fn(p)[0]

    return loss_of, flat0


def shift_hessian(fn, params, layout):
    """The exact Hessian of this step's loss (the draw fixed) in the flattened shifts of the affine and additive
    sites (forward over reverse mode), symmetrised."""
    loss_of, flat0 = _flat_shift_loss(fn, params, layout)
    hess = jax.jacfwd(jax.grad(loss_of))(flat0)
    return 0.5 * (hess + hess.T)


def hessian_diagonals(hess, params, layout):
    """``{loc name: diag(H) shaped like the loc}`` of the shift Hessian."""
    out, start, diag = {}, 0, jnp.diagonal(hess)
    for b in _shift_blocks(layout):
        n = int(np.prod(jnp.shape(params[b.loc_param])))
        out[b.loc_param] = diag[start:start + n].reshape(jnp.shape(params[b.loc_param]))
        start += n
    return out


class _ProbedSite(NamedTuple):
    """An affine shift block as :func:`~numpyro_blr.estimators.svi.probe_directions` reads it: one site, one probe."""

    loc: str
    segments: tuple = ()


def probed_loss_and_diagonals(fn, params, layout, key, forward_mode=False):
    r"""``((loss, aux), grads, {loc name: estimate of diag(A H A)})`` for the affine shift blocks, in one
    forward-over-reverse pass: :math:`H` the Hessian of this step's loss in the shifts (the draw fixed), :math:`A`
    the blocks' scales. ``nb.BLR``'s ``"hutchinson"`` estimator (:func:`~numpyro_blr.estimators.svi.probe_directions`,
    :func:`~numpyro_blr.estimators.svi.hutchinson_diagonal`), probed in the same whitened coordinates: each site its
    own Rademacher probe :math:`A\odot r` (up to ``MAX_PROBES``), so that a global scalar's estimate is free of its
    coupling to the other sites, and :math:`A^2\,\hat H_{ii} = r_i A_i (H A r)_i`, unbiased for
    :math:`(AHA)_{ii} = A_i^2 H_{ii}`, whose expectation under :math:`q` is the scale's algebra gradient plus one by
    Stein's lemma (:math:`\mathbb E[A\epsilon U'(z)] = \mathbb E[A^2 U''(z)]`, Gaussian :math:`q_0`). The additive
    blocks are not probed (no scale to step). ``key`` must not depend on this step's draw."""
    affine = [b for b in _shift_blocks(layout) if b.group == "affine"]
    if not affine:
        return (*_value_and_grad(fn, x=params, forward_mode_differentiation=forward_mode), {})
    signs, scales = {}, {}
    for b, k in zip(affine, jax.random.split(key, len(affine))):
        loc = params[b.loc_param]
        signs[b.loc_param] = jax.random.rademacher(k, jnp.shape(loc), jnp.result_type(loc))
        scales[b.loc_param] = jnp.broadcast_to(jnp.exp(params[b.scale_param]), jnp.shape(loc)).astype(jnp.result_type(loc))
    tangents, row = probe_directions([_ProbedSite(b.loc_param) for b in affine], scales, signs)
    out, grads, products = loss_gradients_and_products(fn, params, tangents, forward_mode)
    diagonals = {n: scales[n] * scales[n] * hutchinson_diagonal(scales[n], signs[n], probe_product(products[n], row[n]))
                 for n in signs}
    return out, grads, diagonals


DRAW_SEED = 0x11E6  # the extra draws' key: PRNGKey(DRAW_SEED) folded with the step count and the step's sampled loss
PROBE_SEED = 0x11E7  # the diagonal step's Hutchinson probes: PRNGKey(PROBE_SEED) folded with the step count and the shifts
POINT_LOG_SCALE = 60.0  # the scale shrunk by e^-60 puts this step's draw at the loc (below rounding)


def _at_points(params, layout, points):
    r"""``params`` with each shift block's loc at ``points`` (``{loc name: value}``) and its scale shrunk by
    :math:`e^{-60}` (clamped to its dtype): with the draw fixed, this step's loss is
    :math:`f = U(b + A\epsilon) + \log q`, whose :math:`\log q` does not depend on :math:`b`, so its gradient and
    Hessian in the locs there are :math:`U`'s at the points."""
    p = dict(params)
    for b in _shift_blocks(layout):
        p[b.loc_param] = points[b.loc_param]
        p[b.scale_param] = lie.clamp_log_scale(params[b.scale_param] - POINT_LOG_SCALE)
    return p


def extra_draws(fn, params, layout, key, k):
    r"""``(hess, grad, offset, finite)`` at ``k`` fresh draws :math:`z_j = b + A\epsilon_j`,
    :math:`\epsilon_j \sim N(0, I)`, of the affine shift blocks (Gaussian :math:`q_0`): the exact Hessians
    ``(k, n, n)`` (symmetrised) and gradients ``(k, n)`` of :math:`U` in the flattened shifts
    (:func:`_at_points`), the offsets :math:`z_j - b` ``(k, n)`` and whether each draw's are finite ``(k,)``."""
    blocks = _shift_blocks(layout)
    shapes = [jnp.shape(params[b.loc_param]) for b in blocks]
    sizes = [int(np.prod(sh)) for sh in shapes]
    flat0 = jnp.concatenate([params[b.loc_param].reshape(-1) for b in blocks])
    scale = jnp.concatenate([jnp.broadcast_to(jnp.exp(params[b.scale_param]), sh).reshape(-1)
                             for b, sh in zip(blocks, shapes)]).astype(flat0.dtype)
    offsets = scale * jax.random.normal(key, (k, flat0.shape[0]), flat0.dtype)

    def loss_of(flat):
        points, start = {}, 0
        for b, sh, n in zip(blocks, shapes, sizes):
            points[b.loc_param] = flat[start:start + n].reshape(sh).astype(params[b.loc_param].dtype)
            start += n
        return fn(_at_points(params, layout, points))[0]

    grad_fn = jax.grad(loss_of)

    def grad_and_hess(point):
        hess, grad = jax.jacfwd(lambda x: (grad_fn(x), grad_fn(x)), has_aux=True)(point)
        return 0.5 * (hess + hess.T), grad

    hess, grad = jax.lax.map(grad_and_hess, flat0[None, :] + offsets)
    finite = jnp.all(jnp.isfinite(hess), axis=(1, 2)) & jnp.all(jnp.isfinite(grad), axis=1)
    return hess, grad, offsets, finite


def _draw_offset(grad_loc, grad_log_scale, scale):
    r""":math:`z - b = A\epsilon` of this step's draw, read off the gradients: with the draw fixed,
    :math:`\partial L/\partial b = U'(z)` and :math:`\partial L/\partial\log A = A\epsilon\,U'(z) - 1`
    (Gaussian :math:`q_0`, elementwise), so :math:`A\epsilon = (\partial L/\partial\log A + 1)/U'(z)`. Where
    :math:`U'(z)` is too small for the ratio to be resolved (or it gives :math:`|\epsilon| > 10`) the offset is 0:
    that coordinate goes without the control variate."""
    ok = jnp.abs(grad_loc) > 1e3 * jnp.finfo(grad_loc.dtype).eps * jnp.maximum(1.0, jnp.abs(grad_log_scale))
    ratio = (grad_log_scale + 1.0) / jnp.where(ok, grad_loc, jnp.ones_like(grad_loc))
    ok = ok & jnp.isfinite(ratio) & (jnp.abs(ratio) <= 10.0 * scale)
    return jnp.where(ok, ratio, jnp.zeros_like(ratio))


def joint_shift(hess, params, grads, layout, mom, scale_tril, rho, zs, shifts, control=True, extra_offset=None,
                offset_weight=None, offset_grads=None):
    r"""The shifts of the affine and additive sites preconditioned by a dense precision :math:`P` across them
    (``nb.BLR``'s Newton step for mean-field guides, ``_joint_mean_step``); writes them into ``shifts``.

    :math:`P` takes the BLR's precision step from ``hess``, the exact Hessian :math:`\hat H` of this step's loss in
    the shifts (:func:`shift_hessian`; the draw fixed: the Hessian of the unconstrained potential at
    :math:`T^{-1}\theta`), positive definite by the one-sided rule of :func:`~numpyro_blr.rules.blr.full_scale_tril_update`, and
    the shift of the exponential map :math:`-\rho A M_b\varphi(z) = -\rho\varphi(z) A^2\bar g/c_b` becomes
    :math:`-\rho\varphi(z)\,P^{-1}\bar g` (:math:`\bar g` the momentum of the gradient): the same formula with the
    mean-field metric :math:`A^{-2}` replaced by the dense curvature. The fixed point is unchanged
    (:math:`\mathbb E_q[\nabla\ell] = 0`, the mean-field optimum's mean condition); each step is a Newton step rather
    than a damped Jacobi iteration, which on a posterior with correlation :math:`-0.999` between two coefficients
    contracts by :math:`1 - 0.001\rho` per step. The scales keep the group's step (with the algebra gradient read
    off the same Hessian, :math:`X_A = A^2\hat H_{ii} - 1`). With the extra draws of :class:`LieGroupBLR`
    (``curvature_draws``), ``hess`` and ``grads`` are the averages over the :math:`1 + k` draws, ``extra_offset`` is
    :math:`\sum_j w_j A\epsilon_j / (1 + \sum_j w_j)` (:math:`w_j` whether draw :math:`j` is finite) and
    ``offset_weight`` the step's own draw's weight :math:`1/(1 + \sum_j w_j)`, so the control variate is :math:`P`
    times the draws' mean offset; ``offset_grads`` are the step's own gradients, from which its offset is read.

    :math:`P` is carried as ``scale_tril``, the lower Cholesky factor :math:`L` of :math:`P^{-1}`, and stepped in
    whitened coordinates (:func:`~numpyro_blr.rules.blr.full_scale_tril_update` of :math:`L^\top\hat H L`), as
    ``nb.BLR``'s joint step is: :math:`P` is never formed or factorised. Before, :math:`P` itself was carried and the
    Cholesky factor of its inverse taken each step; on a regression whose predictor is in the hundred-thousands
    (robustness case ``kidiq_momiq_x1e3``, float32) that factor was non-finite from the first step and 970 of 1,000
    steps were skipped. Returns the new :math:`L` and the control variate by loc name."""
    from jax.scipy.linalg import solve_triangular

    from numpyro_blr.rules.blr import full_scale_tril_update

    blocks = _shift_blocks(layout)
    shapes = [jnp.shape(params[b.loc_param]) for b in blocks]
    sizes = [int(np.prod(sh)) for sh in shapes]
    flat0 = jnp.concatenate([params[b.loc_param].reshape(-1) for b in blocks])
    gbar, phi, offset = [], [], []
    for b in blocks:
        if b.group == "affine":
            a = jnp.exp(params[b.scale_param])
            gbar.append((mom[b.loc_param] * b.metric_loc / a).reshape(-1))  # M_b = A g / c_b
            og = grads if offset_grads is None else offset_grads
            offset.append(_draw_offset(og[b.loc_param], og[b.scale_param], a).reshape(-1))
            z = zs[b.loc_param]
            decay = jnp.expm1(-z)
            safe = jnp.where(z == 0, jnp.ones_like(z), z)
            phi.append(jnp.where(z == 0, jnp.ones_like(z), -decay / safe).reshape(-1))
        else:
            gbar.append(grads[b.loc_param].reshape(-1))
            phi.append(jnp.ones((int(np.prod(jnp.shape(params[b.loc_param])))), flat0.dtype))
            offset.append(jnp.zeros((int(np.prod(jnp.shape(params[b.loc_param])))), flat0.dtype))
    gbar, phi, offset = jnp.concatenate(gbar), jnp.concatenate(phi), jnp.concatenate(offset)
    if offset_weight is not None:  # this step's draw, weighted as its gradient is in the average
        offset = offset * offset_weight + (0.0 if extra_offset is None else extra_offset)
    cv = jnp.zeros_like(gbar)
    if control:  # nb.BLR's control variate: P_old (z - b) has mean zero and P_old does not depend on the draw
        cv = solve_triangular(scale_tril.T, solve_triangular(scale_tril, offset, lower=True), lower=False)
        cv = jnp.where(jnp.all(jnp.isfinite(cv)), cv, jnp.zeros_like(cv))
        gbar = gbar - cv
    rho = jnp.asarray(rho, flat0.dtype)
    whitened = scale_tril.T @ hess @ scale_tril
    new_tril = full_scale_tril_update(scale_tril, None, rho, "one-sided", 0.5 * (whitened + whitened.T))
    step = -rho * phi * (new_tril @ (new_tril.T @ gbar))
    start, control_by_loc = 0, {}
    for b, sh, n in zip(blocks, shapes, sizes):
        shifts[b.loc_param] = step[start:start + n].reshape(sh).astype(params[b.loc_param].dtype)
        control_by_loc[b.loc_param] = cv[start:start + n].reshape(sh)
        start += n
    return new_tril, control_by_loc


def liegroup_guide_algorithm(lr, scale_lr=None, momentum=0.0, scale_momentum=0.0, clip_radius=1.0, backtrack=True,
                             joint_mean=None, curvature_draws=None, growth_radius=float("inf")):
    """The Lie-group BLR over a :class:`LieGroupGuide`'s parameters, for :class:`~numpyro_blr.svi.GuideOptimizer`.

    ``lr``: a float, a schedule ``count -> rho`` or an :class:`~numpyro_blr.rules.schedules.adaptive_decay` (clock,
    iterate averaging and halving on skipped steps, as ``nb.BLR``); ``scale_lr``: the affine scales' step (default:
    ``lr``'s)."""
    adaptive = bool(getattr(lr, "adaptive", False))
    averaging = adaptive and bool(getattr(lr, "averaging", False))
    curvature_draws = CURVATURE_DRAWS if curvature_draws is None else int(curvature_draws)

    def read_layout(params, optimizer):
        if not isinstance(params, dict):
            raise GuideLayoutError(f"LieGroupBLR expects the dict of parameters that numpyro's SVI builds, got {type(params).__name__}.")
        guide = _find_guide(params, optimizer)
        blocks = guide.blocks(params)
        used = {n for b in blocks for n in (b.loc_param, b.scale_param) if n is not None}
        return Layout(blocks, tuple(sorted(set(params) - used)))

    def joint(params, layout):
        if joint_mean is None:  # the default step size only: a given lr runs the group's own (diagonal) rule
            gaussian = all(b.gaussian for b in _shift_blocks(layout))
            return adaptive and gaussian and 0 < _shift_size(params, layout) <= JOINT_MAX_DIM
        return bool(joint_mean) and _shift_size(params, layout) > 0

    def diagonal_estimator(params, layout):
        """Whether the shifts that the joint step does not take use the diagonal step's estimator: with the default
        step size and a Gaussian q0 (a given lr runs the group's own rule)."""
        return adaptive and bool(_shift_blocks(layout)) and all(b.gaussian for b in _shift_blocks(layout))

    def direction_size(params, layout):
        return sum(int(np.prod(jnp.shape(params[n]))) for b in layout.blocks for n in _names(b))

    def init(params, layout):
        for b in layout.blocks:
            for n in _names(b):
                bad = ~jnp.isfinite(params[n])
                if not isinstance(bad, jax.core.Tracer) and bool(jnp.any(bad)):  # traced (nb.fit): steps report it
                    what = "scale" if n == b.scale_param else "loc"
                    reason = ("an initial scale that is not strictly positive (the group keeps scales positive only if "
                              "they start positive)" if what == "scale" else "a non-finite initial loc")
                    raise ValueError(
                        f"LieGroupBLR: site {b.site!r} ({n!r}) has {reason}: {int(jnp.sum(bad))} entries. Pass positive "
                        "finite init_params, or a positive init_scale to the guide."
                    )
        names = [n for b in layout.blocks for n in _names(b)]
        dtype = jnp.result_type(*[params[n] for n in names]) if names else jnp.result_type(float)

        def full(shape, value, dt=dtype):
            return jax.device_put(np.full(shape, value, dtype=dt))

        handles = {b.loc: params[b.loc] for b in layout.blocks}
        trace = FitTrace(
            clock=full((), 0), direction=full((direction_size(params, layout),), 0), rho=full((), 0),
            loss_avg=full((), np.nan), loss_var=full((), 0), loss_best=full((), np.inf), loss_best_var=full((), 0),
            gradient_size={n: full(np.shape(v), 0, jnp.result_type(v)) for n, v in handles.items()},
            gradient_last={n: full(np.shape(v), 0, jnp.result_type(v)) for n, v in handles.items()},
            persistence={n: full(np.shape(v), 1, jnp.result_type(v)) for n, v in handles.items()},
            halvings=full((), 0, np.int32), damped=full((), 0, np.int32), damped_recent=full((), 0), damping=full((), 1),
            loss_blocks=empty_loss_blocks(dtype), loss_blocks_clipped=empty_loss_blocks(dtype),
        )
        momentum_ = {n: jnp.zeros_like(params[n]) for n in names}
        average = {n: params[n] for n in names} if averaging else {}
        if joint(params, layout):  # start from the guide's own (diagonal) precision 1 / (A sd0)^2: L = diag(A sd0)
            diag = []
            for b in _shift_blocks(layout):
                sd = b.base_sd * (jnp.exp(params[b.scale_param]) if b.group == "affine" else 1.0)
                diag.append(jnp.broadcast_to(sd, jnp.shape(params[b.loc_param])).reshape(-1))
            scale_tril = jnp.diag(jnp.concatenate(diag).astype(dtype))
        else:
            scale_tril = full((0, 0), 0)
        return params, LieSVIState(momentum_, jnp.zeros((), jnp.int32), trace, average, scale_tril, jnp.zeros((), bool),
                                   {n: params[n] for n in names})

    def step(fn, params, s, layout, i, forward_mode):
        use_joint = joint(params, layout)
        white_diag, diag_control = {}, {}
        if diagonal_estimator(params, layout) and not use_joint:  # the diagonal step (docstring, "the diagonal step")
            # the probes' key: folded with the step count and the bits of the shifts' sum, which follow the run's
            # rng_key from the first step on; independent of this step's draw, as a Hutchinson probe must be
            shifts_sum = sum(jnp.sum(params[b.loc_param]) for b in _shift_blocks(layout))
            probe_key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(PROBE_SEED), s.count),
                                           lax.bitcast_convert_type(jnp.asarray(shifts_sum, jnp.float32), jnp.uint32))
            (loss, aux), grads, white_diag = probed_loss_and_diagonals(fn, params, layout, probe_key, forward_mode)
        else:
            (loss, aux), grads = _value_and_grad(fn, x=params, forward_mode_differentiation=forward_mode)
        dtype = s.trace.clock.dtype
        if adaptive:  # nb.BLR's schedule: rho_0 / sqrt(1 + c/tau) with averaging, on the noise clock c
            rho = jnp.asarray(lr.iterate(s.trace.clock) if averaging else lr(s.trace.clock), dtype)
            step_lr, step_scale_lr = rho, (rho if scale_lr is None else scale_lr)
        else:
            step_lr, step_scale_lr = lr, (lr if scale_lr is None else scale_lr)
            rho = jnp.asarray(value_at(lr, s.count), dtype)
        new_params, mom, checked = dict(params), dict(s.momentum), {}
        direction, whitened, shifts, zs = {}, {}, {}, {}
        hess = shift_hessian(fn, params, layout) if use_joint else None
        k_draws = curvature_draws if use_joint and all(b.group == "affine" for b in _shift_blocks(layout)) else 0
        step_grads, extra_offset, draws_on = grads, None, s.draws_on
        if k_draws:  # the shift gradient and Hessian averaged over this step's draw and k_draws more (docstring)
            draws_on = s.draws_on | jnp.any(jnp.diagonal(hess) < 0)  # from the next step on
            # folded with the bits of this step's sampled loss, which follows the run's rng_key: another seed,
            # other extra draws (a hash of this step's draw: as good as independent of it)
            key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(DRAW_SEED), s.count),
                                     lax.bitcast_convert_type(jnp.asarray(loss, jnp.float32), jnp.uint32))
            n_flat = hess.shape[0]

            def none(_):
                zeros = jnp.zeros((k_draws, n_flat), hess.dtype)
                return jnp.zeros((k_draws, n_flat, n_flat), hess.dtype), zeros, zeros, jnp.zeros((k_draws,), bool)

            h_k, g_k, off_k, finite = lax.cond(s.draws_on, lambda _: extra_draws(fn, params, layout, key, k_draws),
                                               none, None)
            w = finite.astype(hess.dtype)
            count = 1.0 + jnp.sum(w)
            hess = (hess + jnp.einsum("k,kij->ij", w, jnp.where(finite[:, None, None], h_k, 0.0))) / count
            g_sum = jnp.einsum("k,ki->i", w, jnp.where(finite[:, None], g_k, 0.0))
            extra_offset = jnp.einsum("k,ki->i", w, off_k) / count
            grads, start = dict(grads), 0
            for b in _shift_blocks(layout):
                n = int(np.prod(jnp.shape(params[b.loc_param])))
                extra = g_sum[start:start + n].reshape(jnp.shape(params[b.loc_param])).astype(grads[b.loc_param].dtype)
                grads[b.loc_param] = (grads[b.loc_param] + extra) / count.astype(grads[b.loc_param].dtype)
                start += n
            inv_count = (1.0 / count).astype(hess.dtype)
        hess_diag = hessian_diagonals(hess, params, layout) if use_joint else {}
        for b in layout.blocks:
            if b.group == "affine":
                rule = lie.AffineRule(step_lr, step_scale_lr, momentum, scale_momentum, b.metric_loc, b.metric_scale,
                                      clip_radius, growth_radius)
                log_a = params[b.scale_param]
                a = jnp.exp(log_a)
                x_scale = grads[b.scale_param]
                if b.loc_param in hess_diag:  # Stein: E[A eps dU] = E[A^2 d2U]: the same algebra gradient, less noise
                    x_scale = a * a * hess_diag[b.loc_param] - 1.0
                g_loc = grads[b.loc_param]
                if b.loc_param in white_diag:  # the same Stein identity, from a Hutchinson probe of diag(A H A)
                    x_scale = white_diag[b.loc_param] - 1.0
                    if momentum == 0:  # nb.BLR's control variate: A^-2 (z - b) has mean zero under q
                        diag_control[b.loc_param] = _draw_offset(g_loc, grads[b.scale_param], a) / (a * a)
                        g_loc = g_loc - diag_control[b.loc_param]
                grad = lie.AffineGrad(a * g_loc, x_scale)
                z, shift, m_loc, m_scale = lie.affine_direction(rule, a, mom[b.loc_param], mom[b.scale_param], grad, s.count)
                shifts[b.loc_param], zs[b.loc_param] = shift, z
                new_params[b.scale_param] = lie.clamp_log_scale(log_a - z)
                mom[b.loc_param], mom[b.scale_param] = m_loc, m_scale
                u = grad.loc * b.base_sd  # the mean's distance to the optimum in sds of q (a Gaussian posterior)
                direction[b.loc] = jnp.concatenate([u.reshape(-1), grad.scale.reshape(-1)])
            elif b.group == "multiplicative":
                rule = lie.MultiplicativeRule(step_lr, momentum, b.metric_scale, clip_radius)
                z, mom[b.scale_param] = lie.multiplicative_factor(rule, mom[b.scale_param], grads[b.scale_param], s.count)
                new_params[b.scale_param] = lie.clamp_log_scale(params[b.scale_param] - z)
                u = grads[b.scale_param] / math.sqrt(b.metric_scale)  # in sds of log(theta) under q
                direction[b.loc] = u.reshape(-1)
            else:
                rule = lie.AdditiveRule(step_lr, momentum)
                moved, mom[b.loc_param] = lie.additive_step(rule, params[b.loc_param], mom[b.loc_param],
                                                            grads[b.loc_param], s.count)
                shifts[b.loc_param] = moved - params[b.loc_param]
                u = grads[b.loc_param] * b.base_sd
                direction[b.loc] = u.reshape(-1)
            whitened[b.loc] = u
        new_tril, control = s.mean_scale_tril, diag_control
        if use_joint:
            new_tril, control = joint_shift(hess, params, grads, layout, mom, s.mean_scale_tril, rho if adaptive else
                                        jnp.asarray(value_at(lr, s.count), dtype), zs, shifts, control=momentum == 0,
                                        extra_offset=extra_offset, offset_weight=inv_count if k_draws else None,
                                        offset_grads=step_grads)
        damping = jnp.ones((), dtype)
        if backtrack and shifts:
            damping = _backtrack(fn, params, shifts, loss, control,
                                 draws=(layout, off_k, finite) if k_draws else None)
        for n, d in shifts.items():
            new_params[n] = params[n] + damping.astype(d.dtype) * d
        for b in layout.blocks:
            for n in _names(b):
                checked[n] = (step_grads[n], new_params[n], mom[n])
        if jnp.size(new_tril) and _shift_blocks(layout):
            first = _shift_blocks(layout)[0].loc_param
            checked[first] = checked[first] + (new_tril,)
        skipped = (lr.skipped if averaging else (lambda c: 2.0 * c + lr.halving_steps)) if adaptive else None

        def finish(old, ok):
            """The state once the adapter knows whether the step was finite: the trace records the step either way
            (a skipped step advances the clock, halving rho); the rest is kept only if ``ok``."""
            trace = next_trace(old.trace, i, ok, loss, rho, direction, whitened, skipped, damping)
            average = old.average
            if averaging:  # Polyak-Ruppert: the average of the iterates with weight rho_0 / (1 + c/tau)
                weight = jnp.asarray(lr(trace.clock), dtype)
                average = {n: a + weight.astype(a.dtype) * (new_params[n] - a) for n, a in old.average.items()}
            snapshot = old.snapshot
            if snapshot is not None:  # the returned parameters when a block of losses begins (state of an older run: None)
                returned = {**new_params, **average}
                snapshot = {n: jnp.where(is_block_end(i), returned[n], v) for n, v in snapshot.items()}
            new = LieSVIState(mom, old.count + 1, trace, average, new_tril, draws_on, snapshot)
            return jax.tree.map(lambda x, y: jnp.where(ok, x, y), new, old._replace(trace=trace))

        return GuideStep(loss, aux, step_grads, new_params, finish, checked)

    def result(state, params):
        """The parameters ``get_params`` returns: with averaging, the guide's parameters are the iterates' average."""
        if not state.average:
            return params
        return {**params, **state.average}

    return GuideAlgorithm("LieGroupBLR", init, step, lambda old, finish, ok: finish(old, ok), _report,
                          read_layout=read_layout, result=result)


def _site_names(optimizer, state, names):
    """``{parameter name: site}`` for the guide's parameters (the names themselves when the layout cannot be read)."""
    try:
        blocks = optimizer.layout(state[1].params).blocks
    except Exception:  # noqa: BLE001
        return {n: n for n in names}
    out = {}
    for b in blocks:
        for n in [b.loc] + _names(b):
            out[n] = b.site
    return {n: out.get(n, n) for n in names}


def liegroup_fit_report(result, optimizer):
    r"""The :class:`~numpyro_blr.report.FitReport` of a :class:`LieGroupBLR` run, with messages naming its sites and
    the change that fixes each problem. The evidence is ``nb.BLR``'s (:func:`numpyro_blr.fit_report`: skipped steps,
    divergence of the running loss, means whose whitened gradient :math:`u = A\,\partial L/\partial b` keeps its sign
    while above 1 sd, backtracking still damping), plus scales collapsed to the rounding level and runs too short to
    judge (fewer than ``MIN_STEPS`` steps)."""
    rep = evidence_report(result, optimizer=optimizer)
    obj = getattr(getattr(result, "state", result), "optim_state", getattr(result, "state", result))
    step, s = obj
    steps = rep.steps
    adaptive = optimizer.lr is None or getattr(optimizer.lr, "adaptive", False)
    smaller = ("pass a smaller initial step, nb.LieGroupBLR(lr=nb.adaptive_decay(0.1, 10)), or a smaller clip_radius"
               if adaptive else f"pass a smaller lr (this run used {optimizer.lr!r}), or leave lr unset for the adaptive "
               "default (a step size that decays once the steps are noise, iterate averaging, backtracking)")
    problems, keys = [], []
    sites = _site_names(optimizer, (step, s), rep.nonfinite_parameters)
    if rep.skipped_steps:
        halved = f", and the step size was halved {rep.halvings} time(s), to {rep.step_size:.3g}" if rep.halvings else ""
        listed = ", ".join(f"{n} (site {sites[n]!r})" for n in rep.nonfinite_parameters)
        unusable = " The fit is not usable: most of its steps were skipped." if 2 * rep.skipped_steps > steps else ""
        problems.append(
            f"nb.LieGroupBLR skipped {rep.skipped_steps} of {steps} step(s) because of a non-finite loss, gradient or "
            f"update, for parameter(s) {listed}; those steps kept the last finite values{halved}.{unusable} Check the "
            f"model's log density at the current guide (a scale or rate that reaches 0, an overflowing exp), or "
            f"{smaller}.")
        keys.append(("lie-skipped", rep.skipped_steps, steps))
    if rep.diverged:
        problems.append(
            f"nb.LieGroupBLR diverged: after {steps} steps the average loss ended at {rep.loss_average:.6g}, "
            f"{rep.loss_average - rep.loss_best:.3g} above its best value {rep.loss_best:.6g} in this run: the fit is "
            f"not usable. To fix it, {smaller}.")
        keys.append(("lie-diverged", steps))
    if steps < MIN_STEPS:
        problems.append(
            f"nb.LieGroupBLR: {steps} step(s) are too few to judge the fit (its convergence checks need at least "
            f"{MIN_STEPS}); continue the run (svi.run(key, steps, ..., init_state=svi_result.state)).")
        keys.append(("lie-short", steps))
    elif rep.unconverged and not rep.diverged:
        by_site = {}
        for n, v in rep.unconverged.items():
            site = _site_names(optimizer, (step, s), [n])[n]
            by_site[site] = max(by_site.get(site, 0.0), v)
        listed = ", ".join(f"{k!r} ({v:.3g} sd)" for k, v in sorted(by_site.items(), key=lambda kv: -kv[1]))
        extra = "" if adaptive else f" With a fixed lr (this run used {optimizer.lr!r}), leave lr unset for the adaptive default."
        problems.append(
            f"nb.LieGroupBLR has not converged after {steps} steps: the means of site(s) {listed} are still that many "
            "posterior standard deviations from where the expected gradient vanishes (the step keeps its sign). "
            "Continue the run (svi.run(key, steps, ..., init_state=svi_result.state)); the group's step is diagonal, "
            "so on a strongly correlated posterior it needs many steps: if this persists, fit AutoNormal with nb.BLR() "
            f"(its mean step is a Newton step across sites).{extra}")
        keys.append(("lie-unconverged", steps) + tuple(sorted(by_site)))
    if rep.damped_recent > DAMPED_FRACTION and steps >= MIN_STEPS and not rep.diverged:
        problems.append(
            f"nb.LieGroupBLR: backtracking still shortened the mean step on {100 * rep.damped_recent:.0f}% of the "
            f"recent steps ({rep.damped_steps} of {steps} in all): the diagonal step over-shoots where the fit ended "
            "(strongly correlated coefficients, saturated likelihood terms), so the fit may be short of the optimum. "
            "Continue the run, or fit AutoNormal with nb.BLR().")
        keys.append(("lie-damped", steps))
    try:
        blocks = optimizer.layout(s.params).blocks
    except Exception:  # noqa: BLE001
        blocks = ()
    params = optimizer.algorithm.result(s.algorithm, s.params)
    if not rep.diverged and not rep.unconverged and steps >= MIN_STEPS:
        drops = [(d, how) for d, how in ((rep.loss_drop, ""), (rep.loss_drop_clipped, " (losses winsorised at their "
                                                                 f"running average +- {CLIP_SDS:g} sds)"))
                 if d is not None and d[2] >= STILL_FALLING_MIN and d[0] > STILL_FALLING_SES * d[1]]
        moved = _moved_sites(getattr(s.algorithm, "snapshot", None), params, blocks) if drops else []
        drift = bool(moved) and moved[0][1] >= DRIFT_SDS
        falling = [(d, how) for d, how in drops if _is_falling(d) or (drift and d[0] > DRIFT_NATS)]
        if falling and not moved and max(d[0] for d, _ in falling) <= STILL_FALLING_ALONE_NATS:
            falling = []  # the iterates' losses fall as the step size decays while the returned fit stays put
        if falling:
            (drop, se, _, start_prev, start_cur), how = falling[0]
            named = ("" if not moved else f" The means that moved most since step {start_cur}: "
                     + ", ".join(f"{k!r} ({v:.2g} sd)" for k, v in moved) + ".")
            problems.append(
                f"nb.LieGroupBLR has likely not converged after {steps} steps: the loss was still falling at the end, "
                f"its average over steps {start_cur}-{steps} {drop:.3g} +- {se:.2g} nats below that over steps "
                f"{start_prev}-{start_cur - 1}{how}.{named} The group's scale steps are diagonal, so where the "
                "posterior couples sites (a scale and the values it governs) the fit creeps: continue the run "
                "(svi.run(key, steps, ..., init_state=svi_result.state)) until this stops, or fit AutoNormal with "
                "nb.BLR().")
            keys.append(("lie-still-falling", steps) + tuple(k for k, _ in moved))
    collapsed = []
    for b in blocks:
        if b.scale_param is None:
            continue
        log_scale = np.asarray(params[b.scale_param], dtype=float)
        mean = np.asarray(params[b.loc_param], dtype=float) if b.loc_param else 1.0
        if np.any(collapsed_sd(np.exp(log_scale), mean, np.asarray(params[b.scale_param]).dtype)):
            collapsed.append(b.site)
    if collapsed and not rep.diverged:
        problems.append(
            f"nb.LieGroupBLR: after {steps} steps the guide's scale collapsed to the rounding level of the mean at "
            f"site(s) {collapsed}: the posterior there is degenerate (a hierarchical scale going to 0) or the scale "
            f"step over-shot. Reparameterise the site (LocScaleReparam for a hierarchical scale) or {smaller}.")
        keys.append(("lie-collapsed", steps) + tuple(collapsed))
    return rep._replace(problems=problems, problem_keys=keys, collapsed=collapsed, name="nb.LieGroupBLR")


def _moved_sites(snapshot, params, blocks, top=5):
    r"""``[(site, sds), ...]``: the sites whose location moved most since the snapshot (``LieSVIState.snapshot``), in
    sds of :math:`q` (the shift over :math:`A\,\mathrm{sd}(q_0)`, or the log-scale of a multiplicative site over the
    sd of :math:`\log\theta`), at least ``MOVED_SDS``."""
    if not snapshot:
        return []
    out = {}
    for b in blocks:
        if b.group == "multiplicative":
            name, sd = b.scale_param, 1.0 / math.sqrt(b.metric_scale)
        else:
            name = b.loc_param
            sd = b.base_sd * (np.exp(np.asarray(params[b.scale_param], np.float64)) if b.group == "affine" else 1.0)
        if name is None or name not in snapshot:
            continue
        moved = np.abs(np.asarray(params[name], np.float64) - np.asarray(snapshot[name], np.float64)) / sd
        worst = float(np.max(moved)) if np.size(moved) else 0.0
        if worst >= MOVED_SDS:
            out[b.site] = max(out.get(b.site, 0.0), worst)
    return sorted(out.items(), key=lambda kv: -kv[1])[:top]


def _report(state, optimizer):
    """``(key, message)`` for each problem :func:`liegroup_fit_report` finds (warned once per run)."""
    rep = liegroup_fit_report(state, optimizer)
    return list(zip(rep.problem_keys, rep.problems))


class LieGroupBLR(GuideOptimizer):
    r"""The Lie-group BLR for SVI with a :class:`LieGroupGuide` (module docstring).

    :param lr: step size :math:`\rho` of the shift (affine, additive) and of the multiplicative scales. Default
        (``None``): ``nb.BLR()``'s :class:`~numpyro_blr.rules.schedules.adaptive_decay` (0.5, 10): on a clock that
        advances only while successive steps disagree in sign (Kesten's rule: the steps are Monte Carlo noise), the
        parameters step with :math:`0.5/\sqrt{1 + c/10}` and ``get_params`` returns the average of the iterates in
        the group's exponential coordinates (:math:`b`, :math:`\log A`, :math:`\log g`) with weight
        :math:`0.5/(1 + c/10)`; a skipped (non-finite) step halves :math:`\rho`. A float or an optax schedule
        ``step -> lr`` is used as given, with no average; an ``nb.adaptive_decay(...)`` sets the schedule.
    :param scale_lr: step size :math:`\rho_A` of the affine scales (default: ``lr``'s).
    :param momentum: momentum :math:`\beta` of the shift's (and multiplicative scale's) algebra gradient, in [0, 1).
    :param scale_momentum: momentum of the affine scale's algebra gradient, in [0, 1).
    :param clip_radius: bound on the change of a log-scale in one step (default 1: a scale moves by at most a factor
        :math:`e` per step). Far from the posterior, or with a heavy-tailed :math:`q_0` (Student-t with
        :math:`\nu \le 4`: :math:`\epsilon^2` has no variance), one draw can give a huge algebra gradient, and the
        exponential map would turn it into a factor :math:`e^{-\rho X}` that takes hundreds of steps to undo; near
        the fixed point :math:`\rho X` is small and the clip is inactive (``float('inf')`` turns it off).
    :param growth_radius: a tighter bound on the growing side of an affine scale's step, :math:`z \ge -r_g`: a scale
        grows by at most :math:`e^{r_g}` per step (default ``GROWTH_RADIUS`` :math:`= \tfrac12\log 2`, a factor
        :math:`\sqrt2`; ``float('inf')``: ``clip_radius`` on both sides, the rule before). That is the bound of
        ``nb.BLR``'s one-sided precision step (Lin, Schmidt & Khan 2020): there the new precision is
        :math:`k(b) = b + \tfrac12(1-b)^2 \ge \tfrac12` times the last at any sampled curvature, so a variance at
        most doubles, where the exponential map :math:`A \leftarrow Ae^{-\rho X_A/c_A}` with
        :math:`X_A = A^2\hat H_{ii} - 1` grows a scale by the clip's factor :math:`e` on every draw of strongly
        negative curvature. Where each sampled curvature is non-negative, :math:`X_A \ge -1` and the step grows a
        scale by at most :math:`e^{\rho/c_A}` (:math:`e^{0.25}` at the default's first step), which the bound does
        not touch. Measured on ``hierarchical_scales_logistic`` (bench/robustness_cases.py), started where NumPyro's
        ``init_to_median`` put seed 6 (``log_tau_zero`` 5.8, so :math:`\beta_i = e^{\log\tau_i}\tilde\beta_i` in the
        hundreds and the logits saturated): the log-scales' scales grew (the largest from 0.1 to 22 in 13 steps),
        the draws' :math:`e^{\log\tau_i}` overflowed and 982 of 1,000 steps were skipped; ``nb.BLR()`` +
        ``AutoNormal`` from the same start converged. With the bound the Lie-group fit converges from there too
        (tests/guides); of the robustness suite's other cases, the two above ``JOINT_MAX_DIM`` numbers no longer
        diverge and the rest end where they did (docs/lie-group.md).
    :param joint_mean: precondition the shifts with a dense precision across the sites, tracked from the exact
        Hessian of each step's loss (:func:`joint_shift`: ``nb.BLR``'s Newton step for mean-field guides; the
        family and its fixed point are unchanged), and the affine scales' algebra gradient read off the same Hessian
        (:math:`A^2\hat H_{ii} - 1`, Stein's identity). Default ``None``: on with the default (adaptive) ``lr`` when
        the affine and additive sites have a Gaussian :math:`q_0` (whose Fisher metric :math:`A^{-2}` the dense
        curvature generalises) and hold at most ``JOINT_MAX_DIM`` (256) numbers; off with a given ``lr`` (the
        group's own rule, as in the paper) or ``False``: the diagonal step of the group's Fisher metric.

        **The diagonal step** (default ``lr`` and Gaussian :math:`q_0`, where the joint step is off: above
        ``JOINT_MAX_DIM`` numbers, or ``joint_mean=False``) takes ``nb.BLR``'s mean-field estimator
        (``hessian="hutchinson"``) instead of the draw's reparameterisation gradients: the scale's algebra gradient
        is :math:`X_A = r_i A_i (H A r)_i - 1` from a Rademacher probe :math:`r` of this step's Hessian in the shifts
        (:func:`probed_loss_and_diagonals`: ``nb.BLR``'s probes, one per site up to 16, read off the pass that gives
        the loss and its gradients; unbiased for :math:`A^2 H_{ii} - 1`, Stein's identity as above; the probes' key
        ``PRNGKey(PROBE_SEED)`` folded with the step count and the shifts), and the shift's
        gradient subtracts the control variate :math:`A^{-2}(z - b)` (mean zero under :math:`q`; the draw's offset
        read off the gradients, :func:`_draw_offset`), which backtracking accounts for as the joint step's does.
        At the fixed point (:math:`A^2 H = 1` on a Gaussian posterior) the shift's noise then vanishes, as the
        BLR's mean step's does. Measured (1,000 steps, seed 0): the robustness suite's two cases above 256
        numbers, ``varying_intercepts_300`` and ``hierarchical_logistic_400``, ended 1.05-1.10 and 1.25-6.86 nats
        short of ``nb.BLR()`` + ``AutoNormal`` (warned), or diverged; they now end within 0.05 nats of it in
        float64 and float32, their loss flat from step 200 as the yardstick's. With momentum the control variate
        is left out (as in the joint step). Cost: the gradient pass carries a tangent per probe.
    :param curvature_draws: with the joint mean step (affine sites only), the number :math:`k` of extra draws of the
        guide at which the shifts' gradient and Hessian are read and averaged with this step's own (default
        ``None``: ``CURVATURE_DRAWS`` = 8; 0: the one-draw estimate of the rule before), from the step after the first
        whose sampled Hessian has a negative diagonal entry :math:`\hat H_{ii} < 0` (``LieSVIState.draws_on``): only
        there is one draw's :math:`X_A = A^2\hat H_{ii} - 1` unbounded below (where every :math:`\hat H_{ii} \ge 0`,
        :math:`X_A \ge -1` and a scale grows by at most :math:`e^{\rho/c_A}` per step), so a potential convex along
        each coordinate at every draw keeps the one-draw step, bit for bit and at its cost. The switch is read from
        past steps only: the extra draws are independent of the step's own, and the averages stay unbiased. The draws
        :math:`z_j = b + A\epsilon_j`, :math:`\epsilon_j \sim N(0, I)`, come from the rule's own key
        (``PRNGKey(DRAW_SEED)`` folded with the step count and the bits of the step's sampled loss, so that they
        follow the run's ``rng_key``), and :math:`\nabla U(z_j)`, :math:`\nabla^2 U(z_j)` are read off this
        step's loss with the locs at :math:`z_j` and the scales shrunk by :math:`e^{-60}` (with the draw fixed,
        :math:`f(b) = U(b + A\epsilon) + \log q` and :math:`\log q` does not depend on :math:`b`; :func:`extra_draws`).
        So :math:`\bar g = \frac{1}{1+k}\sum_{j=0}^k \nabla U(z_j)` and :math:`\bar H = \frac{1}{1+k}\sum_j
        \nabla^2 U(z_j)`, unbiased for :math:`\mathbb E_q[\nabla U]` and :math:`\mathbb E_q[\nabla^2 U]`: the fixed
        point, the mean-field optimum (:math:`\mathbb E_q[\nabla U] = 0`, :math:`A_i^{-2} = \mathbb E_q[\partial_i^2 U]`),
        is unchanged; the scale's algebra gradient is :math:`X_A = A^2\bar H_{ii} - 1`, the dense precision takes
        :math:`\bar H`, the control variate is :math:`P` times the draws' mean offset (the extra draws' offsets
        :math:`A\epsilon_j` are exact) and backtracking compares the average of the :math:`1 + k` sampled losses, the
        draws moving with the shift (:func:`_backtrack`; without it the averaged step, not a descent direction of one
        draw's loss, was shortened on ~45% of the steps of every case of the robustness suite). Why: the scale moves by
        the exponential map :math:`A \leftarrow A e^{-\rho X_A/c_A}`, and on a log-scale coordinate
        (:math:`\beta_i = e^{t_i}\tilde\beta_i`) one draw's curvature :math:`\partial^2_{t_i} U = 1 + \beta_i^2
        \partial^2_{\beta_i}\ell + \beta_i\partial_{\beta_i}\ell` is negative wherever the draw falls in the concave
        stretch below the likelihood's preferred :math:`|\beta_i|` and grows like :math:`e^{2A|\epsilon|}` above it.
        On ``hierarchical_scales_logistic`` (bench/robustness_cases.py) the one-draw :math:`X_A` of ``log_tau_i``
        ranged over :math:`[-1.6\cdot10^3, 8.8\cdot10^4]` by step 15, the clipped exponential map grew its scales by
        :math:`e` per step (0.8 to 110 in ten steps), the draws left the range where the logits are finite, the
        dense precision (fed the indefinite Hessians through :math:`(I + B^2)/2`) reached :math:`10^{37}`, and 912 of
        1,000 steps were skipped; the average of :math:`1 + k` draws divides the variance of :math:`X_A` by
        :math:`1 + k`. Cost: :math:`k` more gradients and Hessians per step, and :math:`k` more loss evaluations
        (one vectorised call) per backtracking try.
    :param backtrack: shorten the shift by factors of 4 while it raises this step's sample of the loss (the draw
        fixed; :func:`_backtrack`), default ``True``: one loss evaluation per step.
    :param fallback: an optax optimizer for parameters outside the guide (a model's ``numpyro.param``).
    :param guide: the :class:`LieGroupGuide` (found by its parameter names when omitted).

    At the end of ``SVI.run`` (``get_params`` outside ``jit``) it warns, as ``nb.BLR()`` does, about skipped steps,
    divergence, means that have not converged, backtracking that still damps, collapsed scales and runs too short to
    judge, naming the sites and the change that fixes it (:meth:`fit_report`).
    """

    def __init__(self, lr=None, scale_lr=None, momentum=0.0, scale_momentum=0.0, clip_radius=1.0, *, backtrack=True,
                 joint_mean=None, curvature_draws=None, growth_radius=GROWTH_RADIUS, fallback=None, guide=None):
        from numpyro_blr.core import check_fraction, check_positive
        from numpyro_blr.presets import _lr

        if guide is not None and not isinstance(guide, LieGroupGuide):
            raise ValueError(f"LieGroupBLR fits a nb.LieGroupGuide, got guide={type(guide).__name__}.")
        if not isinstance(backtrack, (bool, np.bool_)):
            raise ValueError(f"backtrack must be True or False, got {backtrack!r}.")
        if joint_mean is not None and not isinstance(joint_mean, (bool, np.bool_)):
            raise ValueError(f"joint_mean must be None (automatic), True or False, got {joint_mean!r}.")
        if curvature_draws is not None and (isinstance(curvature_draws, (bool, np.bool_)) or not
                                            isinstance(curvature_draws, (int, np.integer)) or curvature_draws < 0):
            raise ValueError(f"curvature_draws must be None (the default, {CURVATURE_DRAWS}) or an integer >= 0, got "
                             f"{curvature_draws!r}.")
        self.curvature_draws = CURVATURE_DRAWS if curvature_draws is None else int(curvature_draws)
        self.lr = lr
        if lr is None:
            schedule = adaptive_decay(*DEFAULT_LR)
        elif getattr(lr, "adaptive", False):
            schedule = lr
        else:
            schedule = _lr(lr)
        scale_lr = None if scale_lr is None else _lr(scale_lr)
        if scale_lr is None and not getattr(schedule, "adaptive", False):
            scale_lr = schedule
        self.backtrack = bool(backtrack)
        algorithm = liegroup_guide_algorithm(schedule, scale_lr, check_fraction(momentum, "momentum"),
                                             check_fraction(scale_momentum, "scale_momentum"),
                                             check_positive(clip_radius, "clip_radius", allow_inf=True), self.backtrack,
                                             joint_mean, self.curvature_draws,
                                             check_positive(growth_radius, "growth_radius", allow_inf=True))
        super().__init__(algorithm, fallback=fallback, guide=guide, prefix=getattr(guide, "prefix", None))

    def fit_report(self, result):
        """The :class:`~numpyro_blr.report.FitReport` of a run (``svi_result``, its ``.state`` or the optimizer state)
        with this optimizer's messages (:func:`liegroup_fit_report`)."""
        return liegroup_fit_report(result, self)

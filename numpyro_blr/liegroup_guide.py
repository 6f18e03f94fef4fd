r"""The Lie-group BLR in NumPyro: :class:`LieGroupGuide` over a model's latent sites and :class:`LieGroupBLR`,
its optimizer::

    guide = nb.LieGroupGuide(model, group="affine", base=dist.StudentT(3.0))
    svi = SVI(model, guide, nb.LieGroupBLR(lr=0.1), Trace_ELBO())

Each latent site's guide is the push-forward of a base distribution :math:`q_0` (any reparameterisable
univariate NumPyro distribution) by a group element, elementwise (Kiral, Moellenhoff & Khan 2023;
:mod:`numpyro_blr.rules.liegroup`):

==========================  ======================================  ===========================================
site                        group                                   guide parameters (``{site}_{prefix}_...``)
==========================  ======================================  ===========================================
positive support            multiplicative: :math:`\theta = g\xi`,  ``scale`` :math:`g` (no softplus, no exp of a
                            :math:`\xi \sim` ``positive_base``      Gaussian: :math:`\theta` itself is drawn)
any other continuous        affine: :math:`T(b + A\epsilon)`        ``loc`` :math:`b`, ``scale`` :math:`A`
                            additive: :math:`T(b + \xi)`            ``loc`` :math:`b`
==========================  ======================================  ===========================================

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
outside the guide go to ``fallback``, non-finite steps are skipped and reported). With a Gaussian :math:`q_0`
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

import jax
import jax.numpy as jnp
import numpyro
import numpyro.distributions as dist
from jax import lax
from numpyro.distributions import constraints
from numpyro.distributions.transforms import AffineTransform, biject_to
from numpyro.infer.autoguide import AutoGuide
from numpyro.infer.initialization import init_to_median
from numpyro.distributions.util import periodic_repeat
from numpyro.optim import _value_and_grad

from numpyro_blr.families.registry import base_support
from numpyro_blr.layout import GuideLayoutError, Layout
from numpyro_blr.rules import liegroup as lie
from numpyro_blr.svi import GuideAlgorithm, GuideOptimizer, GuideStep, commit_if_finite, skipped_report

GUIDE_GROUPS = ("affine", "additive", "multiplicative")
_GUIDES = weakref.WeakSet()  # live LieGroupGuides: LieGroupBLR finds its guide among them by parameter names


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
    :param init_loc_fn: where the sites' means start (default ``init_to_median``).
    :param init_scale: the initial standard deviation of the affine sites (unconstrained), a float or
        ``{site: float}``, strictly positive: :math:`A_0` = ``init_scale`` / sd(:math:`q_0`) (or ``init_scale``
        when :math:`q_0` has no finite variance).
    :param metric: the natural-gradient metric: ``"fisher"`` (default: :math:`q_0`'s Fisher information,
        :func:`~numpyro_blr.rules.liegroup.fisher_metric`), ``"identity"`` or ``(c_loc, c_scale)``.
    :param prefix: parameter names are ``{site}_{prefix}_loc`` / ``{site}_{prefix}_scale``.
    """

    def __init__(self, model, *, group="affine", base=None, positive_base=None, groups=None, init_loc_fn=init_to_median,
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
        group = self.groups.get(name, "multiplicative" if positive else self.group)
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
            return dist.TransformedDistribution(base, AffineTransform(values["loc"], values["scale"]))
        if group == "additive":
            return dist.TransformedDistribution(base, AffineTransform(values["loc"], jnp.ones((), ref.dtype)))
        return dist.TransformedDistribution(base, AffineTransform(jnp.zeros((), ref.dtype), values["scale"],
                                                                  domain=constraints.positive))

    def _site_dist(self, name, values):
        """The guide distribution of the site's value (in its support)."""
        info = self._sites[name]
        d = self._latent_dist(name, values)
        if info["group"] == "multiplicative" or base_support(info["support"]) is constraints.real:
            return d
        return dist.TransformedDistribution(d.base_dist, d.transforms + [biject_to(info["support"])])

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
                                names.get("scale"), c_loc, c_scale))
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


# ----------------------------------------------------------------------------- the optimizer


class LieSVIState(NamedTuple):
    """:class:`LieGroupBLR`'s state over the guide's parameters: ``momentum`` per parameter (the momentum of its
    algebra gradient; ``optax.sgd``'s trace for additive shifts) and ``count`` (steps taken)."""

    momentum: dict
    count: jax.Array


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


def liegroup_guide_algorithm(lr, scale_lr=None, momentum=0.0, scale_momentum=0.0, clip_radius=1.0):
    """The Lie-group BLR over a :class:`LieGroupGuide`'s parameters, for :class:`~numpyro_blr.svi.GuideOptimizer`."""

    def read_layout(params, optimizer):
        if not isinstance(params, dict):
            raise GuideLayoutError(f"LieGroupBLR expects the dict of parameters that numpyro's SVI builds, got {type(params).__name__}.")
        guide = _find_guide(params, optimizer)
        blocks = guide.blocks(params)
        used = {n for b in blocks for n in (b.loc_param, b.scale_param) if n is not None}
        return Layout(blocks, tuple(sorted(set(params) - used)))

    def names(b):
        return [n for n in (b.loc_param, b.scale_param) if n is not None]

    def init(params, layout):
        for b in layout.blocks:
            for n in names(b):
                bad = ~jnp.isfinite(params[n])
                if not isinstance(bad, jax.core.Tracer) and bool(jnp.any(bad)):  # traced (nb.fit): steps report it
                    what = "scale" if n == b.scale_param else "loc"
                    reason = ("an initial scale that is not strictly positive (the group keeps scales positive only if "
                              "they start positive)" if what == "scale" else "a non-finite initial loc")
                    raise ValueError(
                        f"LieGroupBLR: site {b.site!r} ({n!r}) has {reason}: {int(jnp.sum(bad))} entries. Pass positive "
                        "finite init_params, or a positive init_scale to the guide."
                    )
        momentum = {n: jnp.zeros_like(params[n]) for b in layout.blocks for n in names(b)}
        return params, LieSVIState(momentum, jnp.zeros((), jnp.int32))

    def step(fn, params, s, layout, i, forward_mode):
        (loss, aux), grads = _value_and_grad(fn, x=params, forward_mode_differentiation=forward_mode)
        new_params, mom, checked = dict(params), dict(s.momentum), {}
        for b in layout.blocks:
            if b.group == "affine":
                rule = lie.AffineRule(lr, scale_lr, momentum, scale_momentum, b.metric_loc, b.metric_scale, clip_radius)
                log_a = params[b.scale_param]
                a = jnp.exp(log_a)
                grad = lie.AffineGrad(a * grads[b.loc_param], grads[b.scale_param])
                z, shift, m_loc, m_scale = lie.affine_direction(rule, a, mom[b.loc_param], mom[b.scale_param], grad, s.count)
                new_params[b.loc_param] = params[b.loc_param] + shift
                new_params[b.scale_param] = lie.clamp_log_scale(log_a - z)
                mom[b.loc_param], mom[b.scale_param] = m_loc, m_scale
            elif b.group == "multiplicative":
                rule = lie.MultiplicativeRule(lr, momentum, b.metric_scale, clip_radius)
                z, mom[b.scale_param] = lie.multiplicative_factor(rule, mom[b.scale_param], grads[b.scale_param], s.count)
                new_params[b.scale_param] = lie.clamp_log_scale(params[b.scale_param] - z)
            else:
                rule = lie.AdditiveRule(lr, momentum)
                new_params[b.loc_param], mom[b.loc_param] = lie.additive_step(rule, params[b.loc_param], mom[b.loc_param],
                                                                              grads[b.loc_param], s.count)
            for n in names(b):
                checked[n] = (grads[n], new_params[n], mom[n])
        return GuideStep(loss, aux, grads, new_params, LieSVIState(mom, s.count + 1), checked)

    report = skipped_report("LieGroupBLR", "Pass a smaller lr (or scale_lr), or check the model's log density at the "
                                           "current guide.")
    return GuideAlgorithm("LieGroupBLR", init, step, commit_if_finite, report, read_layout=read_layout)


class LieGroupBLR(GuideOptimizer):
    r"""The Lie-group BLR for SVI with a :class:`LieGroupGuide` (module docstring).

    :param lr: step size :math:`\rho` of the shift (affine, additive) and of the multiplicative scales: a float > 0
        or a schedule ``step -> lr``.
    :param scale_lr: step size :math:`\rho_A` of the affine scales (default ``lr``).
    :param momentum: momentum :math:`\beta` of the shift's (and multiplicative scale's) algebra gradient, in [0, 1).
    :param scale_momentum: momentum of the affine scale's algebra gradient, in [0, 1).
    :param clip_radius: bound on the change of a log-scale in one step (default 1: a scale moves by at most a factor
        :math:`e` per step). Far from the posterior, or with a heavy-tailed :math:`q_0` (Student-t with
        :math:`\nu \le 4`: :math:`\epsilon^2` has no variance), one draw can give a huge algebra gradient, and the
        exponential map would turn it into a factor :math:`e^{-\rho X}` that takes hundreds of steps to undo; near
        the fixed point :math:`\rho X` is small and the clip is inactive (``float('inf')`` turns it off).
    :param fallback: an optax optimizer for parameters outside the guide (a model's ``numpyro.param``).
    :param guide: the :class:`LieGroupGuide` (found by its parameter names when omitted).
    """

    def __init__(self, lr, scale_lr=None, momentum=0.0, scale_momentum=0.0, clip_radius=1.0, *, fallback=None,
                 guide=None):
        from numpyro_blr.core import check_fraction, check_positive
        from numpyro_blr.presets import _lr

        if guide is not None and not isinstance(guide, LieGroupGuide):
            raise ValueError(f"LieGroupBLR fits a nb.LieGroupGuide, got guide={type(guide).__name__}.")
        lr = _lr(lr)
        scale_lr = lr if scale_lr is None else _lr(scale_lr)
        algorithm = liegroup_guide_algorithm(lr, scale_lr, check_fraction(momentum, "momentum"),
                                             check_fraction(scale_momentum, "scale_momentum"),
                                             check_positive(clip_radius, "clip_radius", allow_inf=True))
        super().__init__(algorithm, fallback=fallback, guide=guide, prefix=getattr(guide, "prefix", None))


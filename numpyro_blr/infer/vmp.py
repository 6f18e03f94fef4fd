r"""Variational message passing, non-conjugate VMP and EM on ordinary NumPyro models: one engine, the BLR per node.

The Bayesian learning rule (Khan & Rue 2023) for a mean-field exponential-family posterior
:math:`q = \prod_i q_i` with natural parameters :math:`\lambda_i` and expectation parameters :math:`\mu_i` is

.. math::
    \lambda_i \leftarrow (1 - \rho)\,\lambda_i + \rho\,\hat\eta_i, \qquad
    \hat\eta_i = \nabla_{\mu_i}\mathbb E_q[\log p(y, z)].

Table 1's message-passing rows are this rule with a choice of :math:`\rho` and family per node:

* **VMP** (Winn & Bishop 2005; :func:`vmp`): :math:`\rho = 1` on every node of a conditionally conjugate
  model, one node after another (Gauss-Seidel): coordinate ascent on the ELBO, which never decreases.
  :math:`\hat\eta_i` is exact (:mod:`.expectations`: quadrature rules exact for the sufficient statistics,
  autodiff through them), a plate of elements is one vectorised update, and a sweep costs O(N) array work.
* **Non-conjugate VMP / conjugate-computation VI** (Knowles & Minka 2011; Khan & Lin 2017; :func:`ncvmp`):
  the same exact step on the conjugate nodes; a Gaussian node whose complete conditional is not Gaussian
  takes the BLR's Gaussian step (:func:`numpyro_blr.rules.blr.gaussian_update`) on the estimate
  :math:`(\mathbb E_q[\nabla\ell], \mathbb E_q[\nabla^2\ell])` of its expected log factors
  (:mod:`numpyro_blr.estimators.gaussian`: cubature, delta, Monte Carlo), other families their improved
  ``blr_update`` on an implicit-reparameterisation estimate (:mod:`numpyro_blr.estimators.implicit`).
* **EM** (Dempster et al. 1977; :func:`em`): ``numpyro.param`` sites and chosen latents are point masses
  updated by the delta method (a Newton step on :math:`\mathbb E_q[\log p]`, backtracked so that it never
  decreases: a generalised M-step), the other nodes :math:`\rho = 1`.

Every algorithm has the package's shape (:class:`MessagePassing`): ``init``, a jit-compiled ``step`` (one
sweep), ``sample``, ``update`` (the rule alone on given messages), ``posterior`` and a ``run`` with a progress
bar and a convergence tolerance on the ELBO. A sweep that goes non-finite is not taken (the state is kept and
``info.skipped`` is set); ``run`` stops there and names the site.
"""

import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist

from numpyro_blr.core import check_positive, select, value_at
from numpyro_blr.estimators import gaussian as gaussian_estimators
from numpyro_blr.estimators import implicit
from numpyro_blr.families import Bernoulli, Categorical, FullGaussian
from numpyro_blr.infer.expectations import (
    check,
    expected_factor,
    find_projection,
    projected_factor,
    reference_values,
    site_rules,
)
from numpyro_blr.infer.graph import FAST_COMPILE, Graph, ModelError, NonConjugateError, Unfreezable, freeze, intern
from numpyro_blr.rules.blr import gaussian_update

__all__ = ["FitResult", "MessagePassing", "SweepInfo", "VMPState", "em", "ncvmp", "vmp"]


class VMPState(NamedTuple):
    """``natural``: site -> the family's natural NamedTuple (element layout, :class:`~.graph.Site`), or the
    unconstrained value of a point site; ``elbo``: the ELBO of this state; ``count``: sweeps taken;
    ``damping``: ``ncvmp``'s backtracking factor on ``nonconjugate_lr`` (None where there is no non-conjugate site)."""

    natural: Dict[str, Any]
    elbo: jax.Array
    count: jax.Array
    damping: Any = None


class SweepInfo(NamedTuple):
    """``loss`` = -ELBO after the sweep; ``skipped``: the sweep was not finite and the state was kept;
    ``elbo``; ``site_ok``/``factor_ok``: finiteness per site (update order) and per factor (trace order);
    ``expected_log_factors`` (per factor, trace order) and ``entropies`` (per site, trace order): the ELBO's terms;
    ``change``: per site (update order), how far the sweep moved it (a Gaussian's mean in posterior sds, the largest
    over its elements; other families' expectation parameters and point values relatively), for the run's report;
    ``rejected``: ``ncvmp`` rejected the sweep because the ELBO decreased (the state was kept, the damping halved)."""

    loss: jax.Array
    skipped: jax.Array
    elbo: jax.Array
    site_ok: jax.Array
    factor_ok: jax.Array
    expected_log_factors: jax.Array = None
    entropies: jax.Array = None
    change: jax.Array = None
    rejected: jax.Array = None


class MessagePassing(NamedTuple):
    """The algorithm shape of :mod:`numpyro_blr.core` plus ``run``, ``posterior`` and ``graph``.

    ``init(init=None, key=None) -> state``; ``step(key, state, *batch) -> (state, info)`` (jit-compiled);
    ``sample(key, state, n) -> {site: draws}``; ``update(state, messages) -> (state, info)``;
    ``run(state, num_steps=..., tol=..., progress_bar=True, key=None) -> FitResult``;
    ``posterior(state) -> {site: distribution}``; ``elbo(state) -> (total, per-factor, entropies)``."""

    init: Callable
    step: Callable
    sample: Callable
    update: Callable
    run: Callable
    posterior: Callable
    elbo: Callable
    graph: Any
    parts: Any = None
    engine: Any = None


@dataclass
class FitResult:
    r"""What :meth:`MessagePassing.run` returns.

    ``state``          the last finite state (``state.natural``: natural parameters per site);
    ``posterior``      site -> NumPyro distribution over the site's value (a ``Delta`` for point sites);
    ``params``         point estimates (``numpyro.param`` sites and ``point=`` latents), constrained;
    ``elbo``           the ELBO of ``state`` (:math:`\sum_\phi \mathbb E_q[\phi] + \sum_i\mathcal H(q_i)`, all
                       constants); ``elbo_history``: before the first sweep and after each;
    ``converged``      the relative ELBO change fell below ``tol`` (and no component collapsed); ``diverged``: the
                       site (or factor) that went non-finite, else None; ``num_steps``: sweeps taken;
    ``report``         :class:`~.report.Report`: converged or not, the sites still moving, what to change (each
                       problem is also warned at the end of ``run``);
    ``guide``          a NumPyro guide function sampling :math:`q` (``nb.diagnostics.to_datatree(result.guide,
                       result.params, model, *args)``, ``numpyro.infer.Predictive``).
    """

    state: Any
    posterior: Dict[str, Any]
    params: Dict[str, Any]
    elbo: float
    elbo_history: List[float]
    converged: bool
    num_steps: int
    diverged: Optional[str]
    guide: Callable = None
    expected_log_factors: Dict[str, float] = field(default_factory=dict)
    entropies: Dict[str, float] = field(default_factory=dict)
    report: Any = None


#: below this many data values a sweep is compiled with cheap XLA backend optimisation, above it fully optimised.
#: Measured on the D = 5, K = 20 mixture at N = 10^5 (5 x 10^5 values, 2 CPU cores): 2.5 s to compile and 88 ms per
#: sweep against 4.1 s and 62 ms; a fit of 10-20 sweeps breaks even near 2 x 10^6 values
FAST_COMPILE_BELOW = 2**20

#: ncvmp's backtracking: a sweep whose ELBO falls more than this many machine epsilons (relative) below the last one
#: is rejected and the non-conjugate step halved, down to MIN_DAMPING times ``nonconjugate_lr``
DECREASE_EPS = 1e3
MIN_DAMPING = 2.0**-10

def _progress(num_steps, desc, show):
    """``range(num_steps)`` as a tqdm bar (a silent one unless ``show``)."""
    from tqdm.auto import tqdm

    return tqdm(range(num_steps), desc=desc, leave=False, disable=not show)


class _Engine:
    """The shared mechanics: the graph, the node kinds, messages, updates, the ELBO."""

    def __init__(self, model, args, kwargs, *, lr=1.0, order=None, point=(), check_model=True, rtol=None,
                 nonconjugate=False, estimator="cubature", num_samples=8, nc_lr=1.0, improved="one-sided",
                 point_steps=1, plates=None, seed=0, name="vmp", backtrack=False):
        if not callable(lr):
            lr = check_positive(lr, "lr")
            if lr > 1.0:
                raise ValueError(f"{name}: lr must be in (0, 1], got {lr}.")
        if estimator not in gaussian_estimators.METHODS + ("projected",):
            raise ValueError(f"{name}: estimator must be one of {gaussian_estimators.METHODS}, got {estimator!r}.")
        if not callable(nc_lr):
            nc_lr = check_positive(nc_lr, "nonconjugate_lr")
            if nc_lr > 1.0:
                raise ValueError(f"{name}: nonconjugate_lr must be in (0, 1], got {nc_lr}.")
        if isinstance(num_samples, bool) or not isinstance(num_samples, (int, np.integer)) or num_samples < 1:
            raise ValueError(f"{name}: num_samples must be a positive integer (the Monte Carlo draws per sweep of "
                             f"estimator='reparam'/'autodiff' and of Gamma/Beta/Dirichlet sites), got {num_samples!r}.")
        self.name, self.lr, self.nc_lr, self.improved = name, lr, nc_lr, improved
        self.estimator, self.num_samples, self.point_steps = estimator, int(num_samples), int(point_steps)
        self.backtrack = backtrack
        self.graph = graph = Graph(model, args, kwargs, point=point, plates=plates)
        self.float_dtype = graph.float_dtype
        self.rtol = rtol if rtol is not None else (1e-6 if self.float_dtype == jnp.float64 else 1e-3)
        names = list(graph.sites)
        if order is None:
            order = names
        else:
            order = list(order)
            missing = [n for n in names if n not in order]
            unknown = [n for n in order if n not in names]
            if unknown or missing or len(set(order)) != len(order):
                raise ValueError(f"{name}: order must name every site once; unknown {unknown}, missing {missing} "
                                 f"(sites: {names}).")
        self.order = order
        self._prior_jit = graph.jit(self._prior, key=self.static_key("prior"))
        self._valid_jit = graph.jit(lambda nat: {n: s.is_valid(nat[n]) for n, s in graph.sites.items()},
                                    key=("valid",), data=False)
        prior, finite = self._prior_jit()
        bad = [n for n, ok in finite.items() if not bool(ok)]
        if bad:
            raise ModelError(f"{name}: observed site '{bad[0]}' has non-finite values (NaN or inf); remove or mask them "
                             "(numpyro.handlers.mask / obs_mask) before fitting.")
        self._prior_natural = prior
        for n in names:
            s = graph.sites[n]
            if s.discrete and s.num_elements > 1 and not all(graph.is_local(n, f) for f in graph.factors_of(n)):
                f = next(f for f in graph.factors_of(n) if not graph.is_local(n, f))
                raise ModelError(
                    f"{s.describe()} has {s.num_elements} elements that are not all in factor '{f.name}''s plates; "
                    "message passing enumerates a discrete site per element, which needs each of its elements read by "
                    "one element of every factor: declare its axes with numpyro.plate (the factor inside them).")
        graph.choose_paths()
        self.kind = {n: ("point" if graph.sites[n].kind == "point" else "conjugate") for n in names}
        if check_model:
            failures = check(graph, prior, self.rtol)
            for kind, f, n, err in failures:
                s = graph.sites[n]
                if kind == "elements":
                    raise ModelError(
                        f"{s.describe()}: its {s.num_elements} elements interact in factor '{f}' (a product of two of "
                        f"them, e.g. a dot product; relative mixed difference {err:.2e}); mean field across elements "
                        "needs each element of the factor to read one element of the site. Declare the interacting "
                        "axes as one event (.to_event(...)) so that they share one dense Gaussian.")
                if nonconjugate and s.kind != "point":
                    self.kind[n] = "nonconjugate"
                    continue
                if kind == "nonfinite":
                    raise ModelError(
                        f"factor '{f}' is not finite at values of {s.describe()} near its initial q (its prior): the "
                        "log density overflows or leaves its support there. Check the factor's scales (a zero "
                        "standard deviation?) and the prior's, or use numpyro_blr.infer.ncvmp if the factor is not "
                        "conjugate.")
                raise NonConjugateError(
                    f"{s.describe()} is not conjugate: the log joint is not linear in its sufficient statistics given "
                    f"the other sites (factor '{f}' breaks it; relative error of the linearity test {err:.2e}), so its complete "
                    f"conditional is not {s.info.label if s.info else 'a point'}. Exact VMP needs every complete "
                    f"conditional in the prior's family: use numpyro_blr.infer.ncvmp (non-conjugate VMP: exact steps on "
                    f"the conjugate sites, the BLR's natural-gradient step on this one), or nb.BLR with SVI.")
        if self.backtrack is None:  # auto: where the step and the ELBO are computed by the same deterministic rule
            self.backtrack = estimator in ("projected", "cubature") and all(
                graph.sites[n].kind == "gaussian" for n, k in self.kind.items() if k == "nonconjugate")
        self.backtrack = bool(self.backtrack)
        self.seed = seed
        self.projected = {}
        gauss_nc = [n for n, k in self.kind.items() if k == "nonconjugate" and graph.sites[n].kind == "gaussian"]
        if nonconjugate and estimator == "projected" and gauss_nc:
            for f in graph.factors.values():
                sites = tuple(n for n in f.deps if n in gauss_nc)
                if sites and f.name not in sites:
                    spec = find_projection(graph, f, sites, prior, self.rtol)
                    if spec is not None:
                        self.projected[f.name] = (sites, spec)

    # --- compiled programs shared across objects (issue 24) ----------------------------------------------
    #: attributes that are not options or structure: the graph (its own key), arrays of this object's data,
    #: compiled wrappers, memos
    _NOT_STATIC = frozenset({"graph", "_prior_natural", "_prior_jit", "_valid_jit", "_posterior_jit", "_params_jit",
                             "jitted_step", "elbo_jit", "jitted", "_args", "_kwargs", "_full", "_full_fn",
                             "_data_scale_memo"})

    def static_key(self, what):
        """The key of this engine's compiled function ``what`` (:meth:`Graph.jit`): its class and every attribute
        but :attr:`_NOT_STATIC` (options such as ``lr``, ``estimator``, ``num_samples``, the update order, each
        site's kind, the projections found), frozen (:func:`~.graph.freeze`); None if some cannot be frozen (then
        the object compiles its own programs). A traced method reads nothing else of the engine but the graph:
        an attribute added later is part of the key unless listed in :attr:`_NOT_STATIC`."""
        try:
            return intern((what, type(self), tuple((k, freeze(v)) for k, v in sorted(vars(self).items())
                                                   if k not in self._NOT_STATIC)))
        except Unfreezable:
            return None

    # --- init -------------------------------------------------------------------------------------
    def _prior(self, init=None):
        """Natural parameters of each site's prior (other sites at their prior means), with ``init`` overrides;
        and whether each observed site's values are finite."""
        graph = self.graph
        tr = graph.run({}, {})
        natural = {}
        init = init or {}
        for n, s in graph.sites.items():
            start = init.get(n, tr[n]["fn"] if not s.is_param else None)
            if s.kind == "point":
                value = init.get(n, tr[n]["value"])
                if isinstance(value, dist.Distribution):
                    value = value.mean
                natural[n] = s.transform.inv(jnp.asarray(value, self.float_dtype))
            elif isinstance(start, dist.Distribution):
                natural[n] = s.natural_from_dist(start)
            elif isinstance(start, tuple) and hasattr(start, "_fields"):
                natural[n] = type(start)(*[jnp.asarray(a, self.float_dtype) for a in start])
            elif s.kind in ("categorical", "bernoulli"):
                probs = jnp.clip(jnp.asarray(start, self.float_dtype), jnp.finfo(self.float_dtype).tiny, None)
                if s.kind == "categorical":
                    probs = probs / jnp.sum(probs, -1, keepdims=True)
                else:
                    probs = jnp.clip(probs, None, 1.0 - jnp.finfo(self.float_dtype).eps)
                natural[n] = (Categorical if s.kind == "categorical" else Bernoulli).from_probs(probs)
            else:
                raise ValueError(f"{self.name}: init['{n}'] must be a NumPyro distribution over the site, the family's "
                                 f"natural parameters, or probabilities for a discrete site; got {type(start).__name__}.")
        finite = {n: jnp.all(jnp.isfinite(jnp.asarray(tr[n]["value"], self.float_dtype)))
                  for n, f in graph.factors.items() if f.observed and jnp.issubdtype(jnp.result_type(tr[n]["value"]), jnp.number)}
        return natural, finite

    def init(self, init=None, key=None):
        """The initial :class:`VMPState`: every site at its prior (other sites at their prior means), ``init``
        (site -> a NumPyro distribution, the family's natural NamedTuple, probabilities for a discrete site, or a
        value for a point site) overriding. With ``key``, discrete sites of more than one element start from
        random responsibilities (Dirichlet(1) per element): a mixture's symmetric prior is a fixed point of VMP."""
        init = dict(init or {})
        if key is not None:
            for n, s in self.graph.sites.items():
                if s.discrete and n not in init and s.num_elements > 1:
                    key, sub = jax.random.split(key)
                    k = s.num_categories if s.kind == "categorical" else 2
                    shape = (s.batch_shape if s.kind == "categorical" else s.value_shape) + (k,)
                    e = jax.random.exponential(sub, shape, self.float_dtype)  # normalised: Dirichlet(1)
                    probs = e / jnp.sum(e, -1, keepdims=True)
                    init[n] = probs if s.kind == "categorical" else probs[..., 1]
        natural, _ = self._prior_jit(init) if init else (self._prior_natural, None)
        valid = self._valid_jit(natural)
        for n, s in self.graph.sites.items():
            if not bool(valid[n]):
                raise ValueError(f"{self.name}: the initial {s.describe()} is not a valid distribution (non-finite or "
                                 "non-positive parameters); check init['{n}'] and the prior.")
        damping = jnp.ones((), self.float_dtype) if self.adaptive else None
        return VMPState(natural, jnp.asarray(jnp.nan, self.float_dtype), jnp.zeros((), jnp.int32), damping)

    @property
    def adaptive(self):
        """Whether sweeps backtrack: ``ncvmp`` with ``backtrack=True`` and some non-conjugate site."""
        return self.backtrack and any(k == "nonconjugate" for k in self.kind.values())

    # --- expectations -------------------------------------------------------------------------------
    def means(self, natural):
        return {n: s.expectation(natural[n]) for n, s in self.graph.sites.items()}

    def gaussian_moments(self, n, natural):
        """A Gaussian site's block mean and covariance Cholesky factor (element layout)."""
        mean, precision = FullGaussian.from_natural(natural[n])
        return mean, jnp.linalg.cholesky(jnp.linalg.inv(precision))

    def factor_expectation(self, f, rules, refs, natural, gauss=None):
        if f.name in self.projected:
            sites, spec = self.projected[f.name]
            gauss = dict(gauss or {})
            moments = {s: gauss[s] if s in gauss else self.gaussian_moments(s, natural) for s in sites}
            return projected_factor(self.graph, f, spec, moments, rules, refs)
        return expected_factor(self.graph, f, rules, refs)

    def expected(self, names, natural, mean, override=None, gauss=None):
        """:math:`\\sum_f \\mathbb E_q[\\phi_f]` over the factors of the sites ``names`` (``override``: site -> a
        quadrature rule to use instead of its own; ``gauss``: site -> (mean, scale_tril) for projected factors)."""
        graph = self.graph
        fs = {f.name: f for n in names for f in graph.factors_of(n)}
        deps = sorted({d for f in fs.values() for d in f.deps}, key=list(graph.sites).index)
        rules = site_rules(graph, natural, mean, deps)
        if override:
            rules.update(override)
        refs = reference_values(graph, natural)
        return sum((self.factor_expectation(f, rules, refs, natural, gauss) for f in fs.values()),
                   jnp.zeros((), self.float_dtype))

    def message(self, n, natural, mean):
        r""":math:`\hat\eta_n = \nabla_{\mu_n}\mathbb E_q[\log p] / s_n` (the family's expectation NamedTuple), with
        :math:`s_n` the site's scale (a subsampled plate's :math:`N/B`: its :math:`q` stands for that many copies, whose
        entropy counts as many times)."""
        grad = jax.grad(lambda m: self.expected([n], natural, {**mean, n: m}))(mean[n])
        scale = self.graph.sites[n].scale
        return grad if scale == 1.0 else jax.tree.map(lambda g: g / scale, grad)

    def elbo_terms(self, natural):
        graph = self.graph
        mean = self.means(natural)
        rules = site_rules(graph, natural, mean)
        refs = reference_values(graph, natural)
        per_factor = {f: self.factor_expectation(fac, rules, refs, natural) for f, fac in graph.factors.items()}
        entropies = {n: s.scale * s.entropy(natural[n]) for n, s in graph.sites.items()}
        total = sum(per_factor.values(), jnp.zeros((), self.float_dtype)) + sum(entropies.values(), jnp.zeros((), self.float_dtype))
        return total, per_factor, entropies

    # --- node updates -------------------------------------------------------------------------------
    def update_conjugate(self, n, natural, mean, lr):
        s = self.graph.sites[n]
        eta = self.message(n, natural, mean)
        return s.family.blr_update(natural[n], jax.tree.map(jnp.negative, eta), lr, improved=False)

    def exact_sweeps(self, names, num_sweeps, natural, mean):
        r"""``num_sweeps`` exact (:math:`\rho = 1`) sweeps over the conjugate sites ``names``, updating ``natural`` and
        ``mean`` in place."""
        for _ in range(num_sweeps):
            for n in names:
                natural[n] = self.update_conjugate(n, natural, mean, 1.0)
                mean[n] = self.graph.sites[n].expectation(natural[n])

    def update_point(self, n, natural, mean):
        r"""The delta method's step on a point site: a Newton step on :math:`Q(u) = \sum_\phi\mathbb E_q[\phi]` in the
        unconstrained value :math:`u` (absolute eigenvalues of the Hessian, so it ascends), halved until :math:`Q`
        does not decrease (a generalised M-step: the ELBO never decreases)."""
        u0 = natural[n]
        shape = u0.shape

        def q(flat):
            return self.expected([n], natural, {**mean, n: flat.reshape(shape)})

        flat0 = u0.reshape(-1)
        for _ in range(self.point_steps):
            value, g = jax.value_and_grad(q)(flat0)
            h = jax.hessian(q)(flat0)
            w, v = jnp.linalg.eigh(-0.5 * (h + h.T))
            w = jnp.maximum(jnp.abs(w), 1e-10 * jnp.max(jnp.abs(w)) + 1e-30)
            step = v @ ((v.T @ g) / w)

            def cond(carry):
                t, _, better = carry
                return (~better) & (t > 2.0**-30)

            def body(carry):
                t, _, _ = carry
                t = 0.5 * t
                cand = flat0 + t * step
                val = q(cand)
                return t, cand, jnp.isfinite(val) & (val >= value)

            cand = flat0 + step
            val = q(cand)
            carry = (jnp.ones((), flat0.dtype), cand, jnp.isfinite(val) & (val >= value))
            _, cand, better = jax.lax.while_loop(cond, body, carry)
            flat0 = jnp.where(better, cand, flat0)
        return flat0.reshape(shape)

    def gaussian_step(self, loc, precision, g, h, lr):
        """:func:`~numpyro_blr.rules.blr.gaussian_update` per element of a Gaussian site, as natural parameters."""
        flat = loc.reshape((-1, loc.shape[-1])), precision.reshape((-1,) + precision.shape[-2:])
        g, h = g.reshape(flat[0].shape), h.reshape(flat[1].shape)
        new_loc, new_prec = jax.vmap(lambda m, p, gg, hh: gaussian_update(m, p, gg, hh, lr, self.improved))(*flat, g, h)
        return FullGaussian.to_natural(new_loc.reshape(loc.shape), new_prec.reshape(precision.shape))

    def update_nonconjugate(self, n, natural, mean, key, lr):
        s = self.graph.sites[n]
        if s.kind == "gaussian" and self.estimator == "projected":
            loc, precision = FullGaussian.from_natural(natural[n])
            cov = jnp.linalg.inv(precision)

            def loss(m, c):
                c = 0.5 * (c + jnp.swapaxes(c, -1, -2))
                expectation = FullGaussian.Expectation(m, c + m[..., :, None] * m[..., None, :])
                rule = s.points(None, expectation)
                chol = jnp.linalg.cholesky(c)
                return -self.expected([n], natural, mean, override={n: rule}, gauss={n: (m, chol)}) / s.scale

            g, g_cov = jax.grad(loss, argnums=(0, 1))(loc, cov)
            h = g_cov + jnp.swapaxes(g_cov, -1, -2)  # Price: E[hessian] = 2 d E / d Sigma (symmetric)
            return self.gaussian_step(loc, precision, g, h, lr)
        if s.kind == "gaussian":
            loc, precision = FullGaussian.from_natural(natural[n])

            def loss(zb):
                value = s.to_value(zb[None])[0]
                one = (value[None], jnp.ones((1,), self.float_dtype))
                zero = (zb, jnp.zeros(zb.shape + zb.shape[-1:], zb.dtype))
                return -self.expected([n], natural, mean, override={n: one}, gauss={n: zero}) / s.scale

            if key is None:  # the same draws every sweep: a deterministic sample-average approximation
                key = jax.random.fold_in(jax.random.PRNGKey(self.seed), self.order.index(n))
            est = gaussian_estimators.estimate(loss, loc, precision, self.estimator, key, self.num_samples)
            return self.gaussian_step(loc, precision, est.grad, est.hessian, lr)
        # Gamma, Beta, Dirichlet: the implicit-reparameterisation path derivative of E_q[-log p + log q] (log q at
        # stopped parameters: no score term, Roeder et al. 2017; estimators.implicit), the improved step. Against
        # the entropy in closed form it adds the path term as a control variate whose noise vanishes where q matches
        # the node's conditional (estimators.implicit's module docstring)
        info, fam = s.info, s.family
        raw = info.unconstrain(info.user(natural[n]))
        if key is None:
            key = jax.random.PRNGKey(self.seed)

        def loss(raw):
            user = info.constrain(raw)
            draws = fam.sample(key, *user, (self.num_samples,))
            one = (draws, jnp.full((self.num_samples,), 1.0 / self.num_samples, self.float_dtype))
            log_q = jnp.mean(fam.log_prob(draws, *jax.tree.map(jax.lax.stop_gradient, user)))  # summed per draw
            return -self.expected([n], natural, mean, override={n: one}) / s.scale + log_q

        est = implicit.estimate(info, raw, jax.grad(loss)(raw))
        return fam.blr_update(natural[n], est.grad, lr, improved=True)

    # --- one sweep ----------------------------------------------------------------------------------
    def sweep(self, key, state):
        adaptive = self.adaptive
        if adaptive and state.damping is None:  # a state built by hand (or by vmp): a full step
            state = state._replace(damping=jnp.ones((), self.float_dtype))
        natural = dict(state.natural)
        mean = self.means(natural)
        start = dict(mean)
        lr = value_at(self.lr, state.count)
        nc_lr = value_at(self.nc_lr, state.count)
        if adaptive:
            nc_lr = nc_lr * state.damping
        ok = []
        for i, n in enumerate(self.order):
            kind = self.kind[n]
            if kind == "conjugate":
                new = self.update_conjugate(n, natural, mean, lr)
            elif kind == "point":
                new = self.update_point(n, natural, mean)
            else:
                sub = None if key is None else jax.random.fold_in(key, i)
                new = self.update_nonconjugate(n, natural, mean, sub, nc_lr)
            natural[n] = new
            mean[n] = self.graph.sites[n].expectation(new)
            ok.append(self.graph.sites[n].is_valid(new))
        elbo, per_factor, entropies = self.elbo_terms(natural)
        site_ok = jnp.stack(ok)
        factors = jnp.stack(list(per_factor.values()))
        good = jnp.all(site_ok) & jnp.isfinite(elbo)
        change = self.change(start, mean)
        if not adaptive:
            new_state = VMPState(natural, elbo, state.count + 1, state.damping)
            new_state = select(good, new_state, state)
            return new_state, SweepInfo(-elbo, ~good, elbo, site_ok, jnp.isfinite(factors), factors,
                                        jnp.stack(list(entropies.values())), change, jnp.zeros((), bool))
        # backtracking (Knowles & Minka 2011 damp non-conjugate steps; nb.BLR halves its step likewise): a finite sweep
        # that decreases the ELBO is rejected and the non-conjugate step halved, down to MIN_DAMPING, where a decrease
        # is taken (and reported); a non-finite sweep is skipped as without backtracking
        prev = state.elbo
        eps = jnp.finfo(self.float_dtype).eps
        decreased = jnp.isfinite(prev) & (elbo < prev - DECREASE_EPS * eps * jnp.maximum(jnp.abs(prev), 1.0))
        floor = state.damping <= MIN_DAMPING
        rejected = good & decreased & ~floor
        damping = jnp.where(rejected, jnp.maximum(0.5 * state.damping, MIN_DAMPING), state.damping)
        new_state = VMPState(natural, elbo, state.count + 1, damping)
        new_state = select(good & ~rejected, new_state, state._replace(damping=damping))
        skipped = ~good
        return new_state, SweepInfo(-elbo, skipped, elbo, site_ok, jnp.isfinite(factors), factors,
                                    jnp.stack(list(entropies.values())), change, rejected)

    def change(self, old, new, names=None):
        """Per site (``names``, default the update order): how far the expectation parameters ``old`` -> ``new``
        (site -> :meth:`Site.expectation`) moved it (:attr:`SweepInfo.change`); a cheap reduction."""
        out = []
        tiny = jnp.finfo(self.float_dtype).tiny
        for n in (self.order if names is None else names):
            s = self.graph.sites[n]
            if s.kind == "gaussian":
                m0, e2 = old[n]
                m1 = new[n][0]
                var = jnp.diagonal(e2, axis1=-2, axis2=-1) - m0**2  # floored at the mean's rounding (float32)
                var = jnp.maximum(var, (jnp.finfo(self.float_dtype).eps * m0) ** 2 + tiny)
                out.append(jnp.max(jnp.abs(m1 - m0) * jax.lax.rsqrt(var)))
            else:
                a = jax.tree.leaves(old[n])[0].astype(self.float_dtype)
                b = jax.tree.leaves(new[n])[0].astype(self.float_dtype)
                scale = 1.0 + jnp.abs(a) if s.kind == "point" else jnp.abs(a) + jnp.abs(b) + tiny
                out.append(jnp.max(jnp.abs(b - a) / scale))
        return jnp.stack(out)

    def apply(self, state, messages, lr=None):
        """The rule alone: :math:`\\lambda_i \\leftarrow (1-\\rho)\\lambda_i + \\rho\\hat\\eta_i` for the given messages."""
        lr = value_at(self.lr, state.count) if lr is None else lr
        natural = dict(state.natural)
        for n, eta in messages.items():
            s = self.graph.sites[n]
            natural[n] = s.family.blr_update(natural[n], jax.tree.map(jnp.negative, eta), lr, improved=False)
        ok = jnp.all(jnp.stack([self.graph.sites[n].is_valid(natural[n]) for n in messages])) if messages else jnp.asarray(True)
        new = select(ok, state._replace(natural=natural), state)
        nan = jnp.asarray(jnp.nan, self.float_dtype)
        return new, SweepInfo(nan, ~ok, nan, jnp.asarray([ok]), jnp.asarray([True]), None, None)

    # --- posterior, sampling, guide -------------------------------------------------------------------
    def posterior(self, state):
        """Site -> the posterior as a NumPyro distribution, built in one compiled call (distributions are pytrees:
        eagerly, each of their few dozen small operations on plate-sized arrays would be compiled on its own)."""
        if getattr(self, "_posterior_jit", None) is None:
            sites = self.graph.sites
            self._posterior_jit = self.graph.jit(lambda natural: {n: s.distribution(natural[n]) for n, s in sites.items()},
                                                 key=("posterior",), data=False)
        return self._posterior_jit(state.natural)

    def params(self, state):
        if getattr(self, "_params_jit", None) is None:
            points = {n: s for n, s in self.graph.sites.items() if s.kind == "point"}
            self._params_jit = self.graph.jit(lambda natural: {n: s.constrained(natural[n]) for n, s in points.items()},
                                              key=("params",), data=False)
        return self._params_jit(state.natural)

    def sample(self, key, state, num_samples):
        post = self.posterior(state)
        keys = jax.random.split(key, len(post))
        return {n: d.sample(k, (num_samples,)) for (n, d), k in zip(post.items(), keys)}

    def guide(self, state):
        posterior = self.posterior(state)
        graph = self.graph

        def guide(*args, **kwargs):
            for n, d in posterior.items():
                if not graph.sites[n].is_param:
                    numpyro.sample(n, d)

        return guide

    def run(self, state, num_steps=1000, tol=1e-6, progress_bar=True, key=None, step=None):
        """Sweeps until the relative ELBO change is at most ``tol`` (``num_steps`` sweeps at most, rejected ones
        included); ends with :class:`~.report.Report` (``result.report``), warning once per problem found."""
        step = step or self.jitted_step
        history = [] if bool(jnp.isnan(state.elbo)) else [float(state.elbo)]
        converged, diverged, taken, last = False, None, 0, None
        rejected, floor_decreases = 0, 0
        bar = _progress(num_steps, self.name, progress_bar)
        for t in bar:
            sub = None if key is None else jax.random.fold_in(key, t)
            new, info = step(sub, state)
            if bool(info.skipped):
                diverged = self._nonfinite_name(info)
                halved = (f" (the non-conjugate step was halved {rejected} time(s) before, to "
                          f"{float(new.damping):.3g} of nonconjugate_lr)") if rejected else ""
                warnings.warn(
                    f"{self.name}: sweep {taken + 1} is not finite ({diverged} went non-finite); stopped and kept the last "
                    f"finite state{halved}. Check the model's scales and priors at the values q reached (a log link with "
                    f"large covariates overflows: standardise them), or damp the step "
                    f"({'nonconjugate_lr' if self.adaptive else 'lr'} < 1).",
                    RuntimeWarning, stacklevel=3)
                break
            if info.rejected is not None and bool(info.rejected):
                state, rejected = new, rejected + 1  # the same natural parameters, the non-conjugate step halved
                continue
            if self.adaptive and history and float(info.elbo) < history[-1]:
                floor_decreases += int(float(info.elbo) < history[-1] - DECREASE_EPS * float(jnp.finfo(self.float_dtype).eps)
                                       * max(abs(history[-1]), 1.0))
            state, taken, last = new, taken + 1, info
            history.append(float(info.elbo))
            bar.set_postfix(elbo=f"{history[-1]:.6g}")
            if tol is not None and len(history) > 1 and abs(history[-1] - history[-2]) <= tol * abs(history[-1]):
                converged = True
                break
        bar.close()
        return self.result(state, history, converged, taken, diverged, last, tol=tol, rejected=rejected,
                           floor_decreases=floor_decreases)

    def report(self, state, history, converged, taken, diverged, info, tol, rejected=0, floor_decreases=0):
        """The run's :class:`~.report.Report`; warns each problem (not when a sweep diverged: that was warned)."""
        from numpyro_blr.infer import report

        damping = 1.0 if getattr(state, "damping", None) is None else float(state.damping)
        rep = report.build(self, self.name, taken, converged, history, tol, info, damping=damping, rejected=rejected,
                           floor_decreases=floor_decreases, state=state)
        if diverged is None:
            for problem in rep.problems:
                warnings.warn(problem, RuntimeWarning, stacklevel=4)
        return rep

    def data_scale(self, n):
        """The spread (standard deviation over all values) of the observed values of the factors that read site ``n``
        (None if none are observed); from the data, on the host, once."""
        memo = getattr(self, "_data_scale_memo", None)
        if memo is None:
            tr = self.graph.run({}, {})
            memo = self._data_scale_memo = {
                f: float(np.std(np.asarray(tr[f]["value"], dtype=float))) if np.size(tr[f]["value"]) > 1 else 0.0
                for f, fac in self.graph.factors.items() if fac.observed}
        scales = [memo[f.name] for f in self.graph.factors_of(n) if f.name in memo]
        return max(scales) if scales else None

    def result(self, state, history, converged, taken, diverged, info=None, tol=None, rejected=0, floor_decreases=0):
        if info is None:
            total, per_factor, entropies = self.elbo_jit(state.natural)
            per_factor, entropies = list(per_factor.values()), list(entropies.values())
        else:
            total, per_factor, entropies = info.elbo, info.expected_log_factors, info.entropies
        rep = self.report(state, history, converged, taken, diverged, info, tol, rejected, floor_decreases)
        return FitResult(
            state=state, posterior=self.posterior(state), params=self.params(state), elbo=float(total),
            elbo_history=history, converged=rep.converged, num_steps=taken, diverged=diverged, guide=self.guide(state),
            expected_log_factors={f: float(v) for f, v in zip(self.graph.factors, per_factor)},
            entropies={n: float(v) for n, v in zip(self.graph.sites, entropies)}, report=rep)

    def _nonfinite_name(self, info, order=None):
        site_ok = np.asarray(info.site_ok)
        for n, ok in zip(self.order if order is None else order, site_ok):
            if not ok:
                return f"site '{n}'"
        factor_ok = np.asarray(info.factor_ok)
        for f, ok in zip(self.graph.factors, factor_ok):
            if not ok:
                return f"the expected log density of factor '{f}'"
        return "the ELBO"

    def algorithm(self, parts):
        small = sum(int(np.size(x)) for x in self.graph.data()) < FAST_COMPILE_BELOW
        options = FAST_COMPILE if small and not os.environ.get("NUMPYRO_BLR_XLA_OPT") else {}
        self.jitted_step = self.graph.jit(lambda key, state, *batch: self.sweep(key, state),
                                          key=self.static_key("sweep"), **options)
        self.elbo_jit = self.graph.jit(self.elbo_terms, key=self.static_key("elbo"))
        return MessagePassing(
            init=self.init,
            step=self.jitted_step,
            sample=self.sample,
            update=self.graph.jit(self.apply, key=self.static_key("apply"), data=False),
            run=self.run,
            posterior=self.posterior,
            elbo=self.elbo_jit,
            graph=self.graph,
            parts=parts,
            engine=self,
        )


def vmp(model, *args, lr=1.0, order=None, check=True, rtol=None, **kwargs):
    r"""Variational message passing on ``model(*args, **kwargs)``: the BLR with :math:`\rho` = ``lr`` (1: exact
    coordinate ascent) on every site of a conditionally conjugate model, Gauss-Seidel in ``order``.

    Every latent sample site gets its prior's exponential family (Normal/MultivariateNormal: a dense Gaussian per
    plate element over its other axes; Gamma/Exponential, Beta, Dirichlet, Bernoulli, Categorical), independent
    across plate elements; ``numpyro.param`` sites are point estimates (as in :func:`em`). Messages are
    :math:`\nabla_\mu\mathbb E_q[\log p]`, read off the model's log density (:mod:`.expectations`); a plate of
    elements is updated in one vectorised step. Subsampled plates are given all their indices.

    Args:
        model: a NumPyro model; ``*args``/``**kwargs`` are its arguments (with the data).
        lr: the BLR step size :math:`\rho \in (0, 1]` (or a schedule ``count -> rho``).
        order: the sites' update order (default: trace order). Sites initialised from data (a mixture's
            responsibilities) should come after the sites their messages read.
        check: test on construction that every complete conditional is in its site's family
            (:func:`.expectations.check`); a failure raises :class:`NonConjugateError` naming the site and factor.
        rtol: that test's tolerance (default 1e-6 in float64, 1e-3 in float32).

    Returns:
        :class:`MessagePassing`; ``run(algo.init(), tol=1e-6)`` fits to a relative ELBO change below ``tol``.

    Raises:
        NonConjugateError: a site with no exponential family here (naming it and the supported priors), or a
            site whose complete conditional is not in its family (naming the site and the factor).
        ModelError: an observed site with non-finite values; elements of one site multiplied together in a factor.
    """
    engine = _Engine(model, args, kwargs, lr=lr, order=order, check_model=check, rtol=rtol, name="vmp")
    return engine.algorithm({"rule": "blr", "lr": lr, "family": "exponential family per site", "estimator": "exact"})


def ncvmp(model, *args, lr=1.0, order=None, estimator="projected", num_samples=256, nonconjugate_lr=1.0,
          improved="one-sided", rtol=None, backtrack=None, **kwargs):
    r"""Non-conjugate VMP (Knowles & Minka 2011; conjugate-computation VI, Khan & Lin 2017): exact :math:`\rho` = ``lr``
    steps on the conjugate sites, the BLR's natural-gradient step with :math:`\rho` = ``nonconjugate_lr`` on the others.

    A site is non-conjugate when a factor breaks the linearity test of :func:`vmp` (a logistic or Poisson link, a
    Student-t likelihood). A Gaussian one takes :func:`numpyro_blr.rules.blr.gaussian_update` (positivity rule
    ``improved``) on :math:`\hat g = \mathbb E_q[\nabla\ell]`, :math:`\hat H = \mathbb E_q[\nabla^2\ell]` of its expected
    log factors, by ``estimator``:

    * ``"projected"`` (default): a factor that reads the site through one parameter of an elementwise distribution,
      affine after an identity/log/logit link (a GLM's linear predictor, a Student-t location), is integrated along
      that parameter by Gauss-Hermite (:func:`.expectations.projected_factor`), and
      :math:`\hat g = \nabla_m`, :math:`\hat H = 2\nabla_\Sigma` of the expectation (Bonnet/Price); other factors by the
      site's cubature rule. Deterministic: a fit converges to a tolerance.
    * ``"cubature"``, ``"delta"``, ``"autodiff"``, ``"reparam"``: :mod:`numpyro_blr.estimators.gaussian` on the expected
      log factors as a function of the value; the Monte Carlo ones draw ``num_samples`` values, the same ones every
      sweep when ``step`` gets no key (a deterministic sample-average approximation), fresh ones with a key (then
      let ``nonconjugate_lr`` decay, e.g. ``lambda t: (t + 1.0) ** -0.7``).

    A Gamma, Beta or Dirichlet one takes its family's improved ``blr_update`` on an implicit-reparameterisation
    estimate (:mod:`numpyro_blr.estimators.implicit`) from ``num_samples`` draws (fixed without a key).
    Expectations of non-conjugate factors elsewhere (the ELBO, other sites' messages) use the projection where it
    applies and the sites' quadrature rules otherwise (exact for conjugate factors).

    **Backtracking** (``backtrack=None``, the default, turns it on when every non-conjugate site is Gaussian and
    ``estimator`` is ``"projected"`` or ``"cubature"``: the step and the ELBO then come from the same deterministic
    rule; ``True`` forces it, ``False`` turns it off): the full natural-gradient step can overshoot (on breast-cancer
    logistic regression with a ``Normal(0, 5)`` prior the ELBO oscillated for 1,000 sweeps at ``nonconjugate_lr=1``).
    A finite sweep whose ELBO falls below the last one's (by more than ``DECREASE_EPS`` epsilons, relative) is rejected
    (``info.rejected``; the state is kept) and the non-conjugate step :math:`\rho =` ``nonconjugate_lr`` :math:`\times`
    ``state.damping`` is halved, down to ``MIN_DAMPING``: the conjugate steps are coordinate ascent, so every accepted
    sweep increases the ELBO (the damping Knowles & Minka 2011 suggest for non-conjugate VMP, made automatic as
    ``nb.BLR``'s backtracking). At the floor a decrease is taken and reported; a non-finite sweep stops the run as in
    :func:`vmp`.
    Without backtracking (Monte Carlo estimates, Gamma/Beta/Dirichlet sites: their fixed point is the sample-average
    one, a little off the ELBO's maximum, so a decrease there is not overshooting) a run that does not converge says
    how often the ELBO decreased and which ``nonconjugate_lr`` to try.
    """
    if estimator in ("reparam", "autodiff") and (isinstance(num_samples, bool) or not isinstance(num_samples, (int, np.integer))
                                                 or num_samples < 1):
        raise ValueError(f"ncvmp: num_samples must be a positive integer for estimator={estimator!r} (the Monte Carlo "
                         f"draws per sweep; 16-256 are typical), got {num_samples!r}.")
    engine = _Engine(model, args, kwargs, lr=lr, order=order, rtol=rtol, nonconjugate=True, estimator=estimator,
                     num_samples=num_samples, nc_lr=nonconjugate_lr, improved=improved, name="ncvmp",
                     backtrack=backtrack)
    return engine.algorithm({"rule": "blr", "lr": lr, "nonconjugate_lr": nonconjugate_lr, "estimator": estimator,
                             "nonconjugate": [n for n, k in engine.kind.items() if k == "nonconjugate"]})


def em(model, *args, point=(), lr=1.0, order=None, point_steps=1, check=True, rtol=None, **kwargs):
    r"""EM as the BLR: ``numpyro.param`` sites and the latent sites named in ``point`` are point masses updated by
    the delta method (``point_steps`` backtracked Newton steps on :math:`\mathbb E_q[\log p]` per sweep: a
    generalised M-step), the other latent sites :math:`\rho = 1` (the E-step; exact when they form one
    conjugate block given the points, as a mixture's assignments). The ELBO never decreases, and after an exact
    E-step it is the log marginal likelihood :math:`\log p(y \mid \theta)` (plus the log prior of point latents)."""
    engine = _Engine(model, args, kwargs, lr=lr, order=order, point=point, check_model=check, rtol=rtol,
                     point_steps=point_steps, name="em")
    return engine.algorithm({"rule": "blr", "lr": lr, "point": list(point), "estimator": "delta (Newton)"})

r"""The posterior of one batch as the prior of the next, for any NumPyro model.

Bayes' rule on a stream :math:`y_1, y_2, \dots` is :math:`p(\theta \mid y_{1:t}) \propto p(y_t \mid \theta)\,
p(\theta \mid y_{1:t-1})`. Khan & Rue (2023, Sec. 5.3 and eq. 2) write it as the Bayesian learning rule with
:math:`\rho = 1`: with :math:`q_{t-1}` the prior of batch :math:`t`,

.. math::
    \lambda_t = \lambda_{t-1} + \nabla_\mu \mathbb E_{q}[\log p(y_t \mid \theta)],

which is exact when the likelihood is conjugate to :math:`q`'s family (one step: exact Bayes) and otherwise is
the best member of the family, a *projection*: :math:`q_t` is the BLR's (variational) fit of
:math:`p(y_t \mid \theta)\,q_{t-1}(\theta)`. The projection error of each batch is measured (importance ratios of
the next batch's posterior to :math:`q_t`, :class:`~numpyro_blr.online.stream.BatchReport`), not assumed away.

This module turns a fitted guide into a :class:`Prior` (:func:`as_prior`) and puts it in place of a model's own
priors (:func:`with_prior`):

==================================================  =====================================================
fitted posterior                                    prior of the next batch
==================================================  =====================================================
``AutoNormal``, ``AutoDiagonalNormal``               per site, ``TransformedDistribution(Normal(loc, scale),
(``ExpFamilyGuide``'s ``"normal"`` sites)            biject_to(support))``: the unconstrained Gaussian
``AutoMultivariateNormal``,                          one joint Gaussian over the sites' unconstrained values
``AutoLowRankMultivariateNormal``,                   (its log density is one ``numpyro.factor``; each site
``AutoLaplaceApproximation``                         samples its marginal, for init strategies)
``ExpFamilyGuide`` (Gamma, Beta, Dirichlet, ...)     the site's fitted distribution
``conjugate_fit`` / ``infer.vmp`` results             each site's posterior distribution (conjugate again)
==================================================  =====================================================

The :class:`Prior` is a JAX pytree whose arrays are the program's inputs: a second batch of the same shapes
reuses the compiled fit (:class:`~numpyro_blr.online.stream.Stream`).
"""

from typing import NamedTuple, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.distributions import constraints
from numpyro.distributions.transforms import biject_to
from numpyro.primitives import Messenger

__all__ = ["Prior", "PriorError", "as_prior", "with_prior", "PRIOR_FACTOR"]

#: the name of the ``numpyro.factor`` site that carries a joint Gaussian prior's log density
PRIOR_FACTOR = "_online_prior"


class PriorError(ValueError):
    """A prior that does not fit the model: a site it names is not a latent site of the model, or its shape or
    support differs. The message names the site."""


class _SiteSpec(NamedTuple):
    """Static description of one site of a Gaussian prior block: its name, the shape of its unconstrained value,
    and its support (as text, to check against the model's site)."""

    name: str
    shape: Tuple[int, ...]
    support: str


def _support_text(support):
    return repr(support)


@jax.tree_util.register_pytree_node_class
class Prior:
    r"""A posterior, ready to be the prior of the next batch (a JAX pytree: its arrays are traced inputs).

    ``loc``, ``scale`` / ``scale_tril``: a Gaussian over the concatenated unconstrained values of the sites in
    ``gaussian_sites`` (in that order): diagonal (``scale``, per-site independent) or full (``scale_tril``, lower
    Cholesky factor of the covariance). ``distributions``: ``{site: NumPyro distribution}`` for sites whose
    posterior is another family (Gamma, Beta, Dirichlet, a conjugate result's Normal or MultivariateNormal over
    the site's value). ``source``: what it was read from (text).
    """

    def __init__(self, loc=None, scale=None, scale_tril=None, gaussian_sites=(), distributions=None, source=""):
        self.loc = loc
        self.scale = scale
        self.scale_tril = scale_tril
        self.gaussian_sites = tuple(gaussian_sites)
        self.distributions = dict(distributions or {})
        self.source = source

    # -- pytree -----------------------------------------------------------------------------------------
    def tree_flatten(self):
        names = tuple(sorted(self.distributions))
        children = (self.loc, self.scale, self.scale_tril, tuple(self.distributions[n] for n in names))
        return children, (self.gaussian_sites, names, self.source)

    @classmethod
    def tree_unflatten(cls, aux, children):
        gaussian_sites, names, source = aux
        loc, scale, scale_tril, dists = children
        return cls(loc, scale, scale_tril, gaussian_sites, dict(zip(names, dists)), source)

    # -- what it holds --------------------------------------------------------------------------------
    @property
    def full(self):
        """True for a joint (full-covariance) Gaussian block."""
        return self.scale_tril is not None

    @property
    def sites(self):
        """The names of the sites this prior replaces."""
        return tuple(s.name for s in self.gaussian_sites) + tuple(sorted(self.distributions))

    def site_slices(self):
        """``{site: slice}``: where each Gaussian site's unconstrained value (flattened) sits in ``loc``."""
        out, start = {}, 0
        for s in self.gaussian_sites:
            size = int(np.prod(s.shape, dtype=int))
            out[s.name] = slice(start, start + size)
            start += size
        return out

    def unconstrained_marginal(self, name):
        r"""The Gaussian of site ``name``'s unconstrained value (flattened): ``Normal`` (diagonal block) or
        ``MultivariateNormal`` (the marginal of the joint block)."""
        sl = self.site_slices()[name]
        if not self.full:
            return dist.Normal(self.loc[sl], self.scale[sl])
        cov = self.scale_tril @ self.scale_tril.T
        return dist.MultivariateNormal(self.loc[sl], covariance_matrix=cov[sl, sl])

    def log_density(self, unconstrained):
        r""":math:`\log q(u)` of the Gaussian block at ``{site: unconstrained value}``."""
        u = jnp.concatenate([jnp.reshape(unconstrained[s.name], (-1,)) for s in self.gaussian_sites])
        if self.full:
            return dist.MultivariateNormal(self.loc, scale_tril=self.scale_tril).log_prob(u)
        return jnp.sum(dist.Normal(self.loc, self.scale).log_prob(u))

    def __repr__(self):
        kind = "full" if self.full else "diagonal"
        parts = []
        if self.gaussian_sites:
            parts.append(f"{kind} Gaussian over {[s.name for s in self.gaussian_sites]}")
        if self.distributions:
            parts.append(", ".join(f"{n}: {type(d).__name__}" for n, d in sorted(self.distributions.items())))
        return f"Prior({'; '.join(parts) or 'empty'}; from {self.source or '?'})"


# -- reading a fitted posterior ---------------------------------------------------------------------------
def _latent_sites(trace):
    return {n: s for n, s in trace.items()
            if s["type"] == "sample" and not s["is_observed"] and not s["infer"].get("is_auxiliary")}


def _unconstrained_shape(site):
    fn = site["fn"]
    return tuple(jnp.shape(biject_to(fn.support).inv(site["value"])))


def _from_autonormal(guide, params):
    specs, locs, scales = [], [], []
    for name, site in _latent_sites(guide.prototype_trace).items():
        loc = jnp.asarray(params[f"{name}_{guide.prefix}_loc"])
        scale = jnp.asarray(params[f"{name}_{guide.prefix}_scale"])
        specs.append(_SiteSpec(name, tuple(loc.shape), _support_text(site["fn"].support)))
        locs.append(loc.reshape(-1))
        scales.append(jnp.broadcast_to(scale, loc.shape).reshape(-1))
    return Prior(jnp.concatenate(locs), jnp.concatenate(scales), None, specs, source=type(guide).__name__)


def _from_autocontinuous(guide, params):
    from numpyro.infer.autoguide import AutoLowRankMultivariateNormal, AutoMultivariateNormal

    post = guide.get_posterior(params)
    # which entries of the guide's flat latent each site takes: unpack 0..D-1
    index = guide._unpack_latent(jnp.arange(guide.latent_dim))
    latent = _latent_sites(guide.prototype_trace)
    specs, order = [], []
    for name, idx in index.items():
        idx = np.asarray(idx, dtype=int)
        specs.append(_SiteSpec(name, tuple(idx.shape), _support_text(latent[name]["fn"].support)))
        order.append(idx.reshape(-1))
    order = np.concatenate(order)
    if isinstance(post, dist.Normal):
        return Prior(post.loc[order], jnp.broadcast_to(post.scale, post.loc.shape)[order], None, specs,
                     source=type(guide).__name__)
    if isinstance(post, (dist.MultivariateNormal, dist.LowRankMultivariateNormal)):
        cov = post.covariance_matrix[np.ix_(order, order)]
        tril = jnp.linalg.cholesky(cov)
        if not bool(jnp.all(jnp.isfinite(tril))):
            raise PriorError(f"{type(guide).__name__}'s covariance is not positive definite (a degenerate fit?): it "
                             "cannot be a prior. Check the fit (nb.fit_report) before using it as a prior.")
        return Prior(post.loc[order], None, tril, specs, source=type(guide).__name__)
    del AutoLowRankMultivariateNormal, AutoMultivariateNormal
    raise PriorError(f"{type(guide).__name__}'s posterior is a {type(post).__name__}, not a Gaussian: as_prior reads "
                     "Gaussian guides (AutoNormal, AutoDiagonalNormal, AutoMultivariateNormal, "
                     "AutoLowRankMultivariateNormal, AutoLaplaceApproximation) and ExpFamilyGuide.")


def _from_expfam(guide, params):
    from numpyro_blr.families.registry import FAMILIES

    guide._check()
    specs, locs, scales, others = [], [], [], {}
    for name, info in guide.sites.items():
        values = guide._values(name, params)
        if info["family"] == "normal":
            loc = jnp.asarray(values["loc"])
            specs.append(_SiteSpec(name, tuple(loc.shape), _support_text(info["support"])))
            locs.append(loc.reshape(-1))
            scales.append(jnp.broadcast_to(values["scale"], loc.shape).reshape(-1))
        else:
            fam = FAMILIES[info["family"]]
            others[name] = fam.distribution(*[values[p] for p in fam.params]).to_event(info["event_dim"] - fam.event_dim)
    loc = jnp.concatenate(locs) if locs else None
    scale = jnp.concatenate(scales) if scales else None
    return Prior(loc, scale, None, specs, others, source="ExpFamilyGuide")


def _from_distributions(posterior, source):
    out = {}
    for name, d in posterior.items():
        if isinstance(d, dist.Delta):
            raise PriorError(f"site {name!r}'s posterior is a point estimate (Delta): it has no spread to be a prior. "
                             "Fit it with a family (drop it from point=...).")
        out[name] = d
    return Prior(distributions=out, source=source)


def as_prior(posterior, params=None) -> Prior:
    r"""The fitted posterior ``posterior`` as a :class:`Prior` for the next batch of the same model.

    :param posterior: a fitted guide (``AutoNormal``, ``AutoDiagonalNormal``, ``AutoMultivariateNormal``,
        ``AutoLowRankMultivariateNormal``, ``AutoLaplaceApproximation``, :class:`~numpyro_blr.ExpFamilyGuide`)
        with its ``params`` (``svi_result.params``); or a result of :func:`~numpyro_blr.conjugate_fit` or
        :func:`numpyro_blr.infer.vmp`/``ncvmp``/``svi`` (its ``posterior``); or a :class:`Prior` (returned as is);
        or a dict ``{site: NumPyro distribution}`` over the sites' values.
    :param params: the guide's parameters (constrained, as ``svi.get_params`` and ``nb.fit`` return them).
    :raises PriorError: a guide with no Gaussian or exponential-family density (``AutoDelta``, flows), a point
        estimate, a covariance that is not positive definite.
    """
    from numpyro.infer.autoguide import AutoContinuous, AutoDelta, AutoNormal

    from numpyro_blr.guides import ExpFamilyGuide

    if isinstance(posterior, Prior):
        return posterior
    if isinstance(posterior, dict):
        return _from_distributions(posterior, "dict")
    if hasattr(posterior, "posterior") and isinstance(getattr(posterior, "posterior"), dict) and params is None:
        return _from_distributions(posterior.posterior, type(posterior).__name__)
    if isinstance(posterior, (AutoDelta,)):
        raise PriorError("AutoDelta is a point estimate: it has no spread to be a prior. Fit a Gaussian guide "
                         "(AutoNormal, AutoMultivariateNormal) or an ExpFamilyGuide.")
    if params is None:
        raise TypeError(f"as_prior({type(posterior).__name__}, params): a guide needs its fitted params "
                        "(svi_result.params).")
    if not isinstance(params, dict):
        raise TypeError(f"params must be the dict of the guide's fitted parameters (svi_result.params), got "
                        f"{type(params).__name__}.")
    if getattr(posterior, "prototype_trace", None) is None and not isinstance(posterior, ExpFamilyGuide):
        if isinstance(posterior, (AutoNormal, AutoContinuous)):
            raise RuntimeError(f"{type(posterior).__name__} is not set up yet: fit it first (nb.fit / svi.run).")
    if isinstance(posterior, AutoNormal):
        return _from_autonormal(posterior, params)
    if isinstance(posterior, AutoContinuous):
        return _from_autocontinuous(posterior, params)
    if isinstance(posterior, ExpFamilyGuide):
        return _from_expfam(posterior, params)
    raise PriorError(
        f"as_prior cannot read a {type(posterior).__name__}: it reads AutoNormal, AutoDiagonalNormal, "
        "AutoMultivariateNormal, AutoLowRankMultivariateNormal, AutoLaplaceApproximation, ExpFamilyGuide, "
        "conjugate_fit / infer results, or a dict {site: distribution}."
    )


# -- putting it in the model ------------------------------------------------------------------------------
class _MarginalOfJoint(dist.Distribution):
    """A site of a joint Gaussian prior: samples the site's marginal (pushed through ``biject_to(support)``), with
    log density 0; the joint density is the ``PRIOR_FACTOR`` factor."""

    pytree_data_fields = ("base",)
    pytree_aux_fields = ("transform", "_support", "unconstrained_shape")

    def __init__(self, base, transform, support, batch_shape, event_shape, unconstrained_shape):
        self.base = base
        self.transform = transform
        self._support = support
        self.unconstrained_shape = unconstrained_shape
        super().__init__(batch_shape=batch_shape, event_shape=event_shape, validate_args=False)

    @constraints.dependent_property(is_discrete=False)
    def support(self):
        return self._support

    def sample(self, key, sample_shape=()):
        u = self.base.sample(key, sample_shape)
        u = jnp.reshape(u, tuple(sample_shape) + self.unconstrained_shape)
        return self.transform(u)

    def log_prob(self, value):
        return jnp.zeros(jnp.shape(value)[: jnp.ndim(value) - len(self.event_shape)], jnp.result_type(float))


def _check_site(name, site, spec=None, d=None):
    """``site`` (a model's sample message) can take ``spec`` (a Gaussian block's site) or ``d`` (a distribution)."""
    fn = site["fn"]
    if site["is_observed"]:
        raise PriorError(f"the prior names site {name!r}, which is observed in the model: a prior replaces latent "
                         "sites only (was the guide fitted to another model?).")
    shape = tuple(fn.batch_shape) + tuple(fn.event_shape)
    if spec is not None:
        have = tuple(biject_to(fn.support).inverse_shape(shape))
        if have != tuple(spec.shape):
            raise PriorError(f"the prior of site {name!r} is over unconstrained values of shape {spec.shape}, but the "
                             f"model's site {name!r} has unconstrained shape {have} (was the guide fitted to another "
                             "model, or does the data change the site's shape?).")
        if spec.support != _support_text(fn.support):
            raise PriorError(f"the prior of site {name!r} has support {spec.support}, but the model's site has support "
                             f"{fn.support}.")
    if d is not None:
        have = tuple(d.batch_shape) + tuple(d.event_shape)
        if have != shape:
            raise PriorError(f"the prior of site {name!r} has shape {have} (batch {tuple(d.batch_shape)}, event "
                             f"{tuple(d.event_shape)}), but the model's site has shape {shape}.")
        if not _same_support(d.support, fn.support):
            raise PriorError(f"the prior of site {name!r} has support {d.support}, but the model's site has support "
                             f"{fn.support}.")


def _same_support(a, b):
    """Supports that are the same set (``positive`` and ``greater_than(0)``, ``real_vector`` and
    ``independent(real, 1)``, ...)."""
    from numpyro_blr.families.registry import base_support

    ba, bb = base_support(a), base_support(b)
    if type(ba) is not type(bb):
        return False
    return _support_text(ba) == _support_text(bb) or ba is bb


class _ReplacePrior(Messenger):
    """Replaces the prior of the sites that ``prior`` names and records their values (for the joint factor)."""

    def __init__(self, fn, prior: Prior):
        self.prior = prior
        self.specs = {s.name: s for s in prior.gaussian_sites}
        self.blocks = prior.site_slices()
        self.values = {}
        self.transforms = {}
        self.seen = set()
        super().__init__(fn)

    def process_message(self, msg):
        name = msg["name"]
        if msg["type"] != "sample" or (name not in self.specs and name not in self.prior.distributions):
            return
        self.seen.add(name)
        fn = msg["fn"]
        if name in self.prior.distributions:
            d = self.prior.distributions[name]
            _check_site(name, msg, d=d)
            msg["fn"] = d
            return
        spec = self.specs[name]
        _check_site(name, msg, spec=spec)
        t = biject_to(fn.support)
        self.transforms[name] = t
        sl = self.blocks[name]
        if not self.prior.full:
            event_dim = t.domain.event_dim + fn.event_dim - t.codomain.event_dim
            base = dist.Normal(jnp.reshape(self.prior.loc[sl], spec.shape),
                               jnp.reshape(self.prior.scale[sl], spec.shape)).to_event(event_dim)
            msg["fn"] = base if _is_identity(fn.support) else dist.TransformedDistribution(base, t)
        else:
            marginal = self.prior.unconstrained_marginal(name)
            msg["fn"] = _MarginalOfJoint(marginal, t, fn.support, fn.batch_shape, fn.event_shape, spec.shape)

    def postprocess_message(self, msg):
        if msg["type"] == "sample" and msg["name"] in self.transforms:
            self.values[msg["name"]] = (msg["value"], self.transforms[msg["name"]])


def _is_identity(support):
    from numpyro_blr.families.registry import base_support

    return base_support(support) is constraints.real


def _joint_log_density(prior, values):
    r"""The joint Gaussian block's density of the constrained values:
    :math:`\log q(u) - \log\lvert\det J_T(u)\rvert` with :math:`u = T^{-1}(\theta)` per site."""
    u, log_det = {}, 0.0
    for s in prior.gaussian_sites:
        theta, t = values[s.name]
        ui = t.inv(theta)
        u[s.name] = ui
        log_det = log_det + jnp.sum(t.log_abs_det_jacobian(ui, theta))
    return prior.log_density(u) - log_det


def run_with_prior(model, prior, args, kwargs):
    """Run ``model(*args, **kwargs)`` with ``prior`` in place of its own priors (inside a NumPyro handler stack)."""
    if prior is None:
        return model(*args, **kwargs)
    handler = _ReplacePrior(model, prior)
    out = handler(*args, **kwargs)
    missing = [n for n in prior.sites if n not in handler.seen]
    if missing:
        raise PriorError(f"the prior names site(s) {missing} that the model does not sample (was the guide fitted to "
                         "another model?).")
    if prior.full and prior.gaussian_sites:
        numpyro.factor(PRIOR_FACTOR, _joint_log_density(prior, handler.values))
    return out


def with_prior(model, prior):
    r"""``model`` with ``prior`` (a :class:`Prior`, or anything :func:`as_prior` reads) in place of its own priors.

    Sites the prior does not name keep the model's priors. A joint Gaussian prior adds one factor site
    (``"_online_prior"``). Every call checks that each site the prior names is a latent site of the model with the
    prior's shape and support (:class:`PriorError` names the site otherwise).

    For a stream of batches use :class:`~numpyro_blr.online.Stream` (its compiled fit is reused from batch to
    batch; a model from ``with_prior`` closes over the prior's values, so each new prior is a new program).
    """
    prior = as_prior(prior)

    def model_with_prior(*args, **kwargs):
        return run_with_prior(model, prior, args, kwargs)

    model_with_prior.__name__ = f"{getattr(model, '__name__', 'model')}_with_prior"
    model_with_prior.__wrapped__ = model
    return model_with_prior

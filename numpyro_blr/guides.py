r"""``ExpFamilyGuide``: a mean-field guide with an exponential family per latent site, chosen by support.

==================================  ===============  =========================================
model site support                  family           guide parameters (``{site}_{prefix}_...``)
==================================  ===============  =========================================
real, real_vector                   ``"normal"``     ``normal_loc``, ``normal_scale``
positive                            ``"gamma"``      ``gamma_concentration``, ``gamma_rate``
unit_interval                       ``"beta"``       ``beta_concentration1``, ``beta_concentration0``
simplex                             ``"dirichlet"``  ``dirichlet_concentration``
boolean                             ``"bernoulli"``  ``bernoulli_logits``
integer_interval(0, K-1)            ``"categorical"`` ``categorical_logits`` (``K`` per element)
==================================  ===============  =========================================

``families={"site": "normal"}`` overrides the choice; ``"normal"`` fits any continuous support
(a Gaussian on the unconstrained value, mapped through ``biject_to(support)``, as ``AutoNormal``),
``"categorical"`` also fits a boolean site. ``nb.BLR`` reads these names (see
:mod:`numpyro_blr.layout`): Normal sites get the Gaussian BLR, the others the family's BLR step
(:mod:`numpyro_blr.expfam_blocks`); discrete sites are enumerated element by element inside the
optimizer, so their gradient has no score-function noise.

Continuous non-Gaussian sites are drawn with NumPyro's implicitly reparameterised samplers (Gamma,
Beta, Dirichlet). Discrete sites are drawn exactly; with an optimizer other than ``nb.BLR`` their
parameters get ``Trace_ELBO``'s (not useful) gradient, so use ``nb.BLR``.
"""

import warnings
from contextlib import ExitStack

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro import handlers
from numpyro.distributions import constraints
from numpyro.distributions.transforms import biject_to

from numpyro_blr import expfam_blocks
from numpyro_blr.layout import EXPFAM_PARAMS

CONTINUOUS_FAMILIES = ("normal", "gamma", "beta", "dirichlet")


def _base_support(support):
    while isinstance(support, constraints.independent):
        support = support.base_constraint
    return support


def _is_zero(x):
    try:
        return float(np.max(np.abs(np.asarray(x)))) == 0.0
    except Exception:  # noqa: BLE001 - a traced bound cannot be checked
        return False


def _num_categories(support):
    """``K`` for ``integer_interval(0, K-1)`` with a concrete upper bound (else None)."""
    if isinstance(support, constraints._IntegerInterval) and _is_zero(support.lower_bound):
        ub = np.asarray(support.upper_bound)
        if ub.size and np.all(ub == ub.flat[0]):
            return int(ub.flat[0]) + 1
    return None


def default_family(support):
    """The family for a support, or None if there is none."""
    base = _base_support(support)
    if base is constraints.boolean:
        return "bernoulli"
    if _num_categories(base) is not None:
        return "categorical"
    if base is constraints.real:
        return "normal"
    if isinstance(base, constraints._Simplex):
        return "dirichlet"
    if isinstance(base, constraints._GreaterThan) and not isinstance(base, constraints._GreaterThanEq) and _is_zero(base.lower_bound):
        return "gamma"
    if isinstance(base, constraints._Interval) and _is_zero(base.lower_bound) and _is_zero(np.asarray(base.upper_bound) - 1):
        return "beta"
    return None


def allowed_families(support):
    if support.is_discrete:
        fam = default_family(support)
        return ("bernoulli", "categorical") if fam == "bernoulli" else ((fam,) if fam else ())
    fam = default_family(support)
    return tuple(dict.fromkeys(([fam] if fam else []) + ["normal"]))


class ExpFamilyGuide:
    r"""Mean-field guide with an exponential family per latent site, chosen by the site's support.

    :param model: the NumPyro model.
    :param families: optional ``{site: family}`` overrides (``"normal"``, ``"gamma"``, ``"beta"``,
        ``"dirichlet"``, ``"bernoulli"``, ``"categorical"``).
    :param init_scale: initial spread: the Gaussian's scale (unconstrained), and the coefficient of
        variation of Gamma / Beta / Dirichlet sites (concentrations about ``1 / init_scale**2``)
        around the prior mean (or a prior draw when the mean is not finite).
    :param prefix: the parameters are named ``{site}_{prefix}_{family}_{param}``.
    :param max_enumerate: the largest number of loss evaluations ``nb.BLR`` spends enumerating one
        discrete site (sum over its elements of their number of values); a larger discrete site is
        updated with the score-function estimator instead.
    :param score_samples: draws of a discrete site per step for the score-function estimator
        (leave-one-out baseline), i.e. its number of loss evaluations.
    """

    def __init__(self, model, families=None, init_scale=0.1, prefix="blr", max_enumerate=expfam_blocks.MAX_ENUMERATE,
                 score_samples=expfam_blocks.SCORE_SAMPLES):
        if not (isinstance(init_scale, (int, float)) and init_scale > 0):
            raise ValueError(f"init_scale must be a positive float, got {init_scale!r}.")
        families = dict(families or {})
        for site, fam in families.items():
            if fam not in EXPFAM_PARAMS:
                raise ValueError(f"families[{site!r}] = {fam!r} is not one of {sorted(EXPFAM_PARAMS)}.")
        self.model = model
        self.families = families
        self.init_scale = float(init_scale)
        self.prefix = prefix
        if isinstance(max_enumerate, bool) or not isinstance(max_enumerate, int) or max_enumerate < 0:
            raise ValueError(f"max_enumerate must be an int >= 0, got {max_enumerate!r}.")
        if isinstance(score_samples, bool) or not isinstance(score_samples, int) or score_samples < 2:
            raise ValueError(f"score_samples must be an int >= 2 (the baseline leaves one sample out), got {score_samples!r}.")
        self.max_enumerate = max_enumerate
        self.score_samples = score_samples
        self.sites = None  # name -> dict(family, shape, event_dim, frames, init, support, dtype)
        self.enumerated = None  # model sites marked infer={"enumerate": "parallel"}: no guide site
        self.plates = None

    # -- setup ----------------------------------------------------------------------------
    def _setup_prototype(self, *args, **kwargs):
        with warnings.catch_warnings():  # outside a seed handler (guide called directly): use key 0
            warnings.simplefilter("ignore", UserWarning)
            key = numpyro.prng_key()
        key = jax.random.PRNGKey(0) if key is None else key
        with handlers.block(), handlers.trace() as tr, handlers.seed(rng_seed=key):
            self.model(*args, **kwargs)
        unknown = set(self.families) - {n for n, s in tr.items() if s["type"] == "sample" and not s["is_observed"]}
        if unknown:
            raise ValueError(f"families names site(s) {sorted(unknown)} that are not latent sample sites of the model.")
        self.plates = {}
        for name, site in tr.items():
            if site["type"] == "plate":
                size, subsample = site["args"][0], site["args"][1]
                if subsample is not None and subsample != size:
                    raise NotImplementedError(
                        f"ExpFamilyGuide does not support subsampling: plate {name!r} has size {size} and "
                        f"subsample_size {subsample}."
                    )
        self.sites = {}
        self.enumerated = []
        for name, site in tr.items():
            if site["type"] != "sample" or site["is_observed"] or site["infer"].get("is_auxiliary"):
                continue
            if site["infer"].get("enumerate") == "parallel":  # summed out by TraceEnum_ELBO, as autoguides do
                if name in self.families:
                    raise ValueError(
                        f"families names site {name!r}, which the model marks infer={{'enumerate': 'parallel'}}: "
                        "an enumerated site is summed out by TraceEnum_ELBO and gets no guide site. Remove the "
                        "mark to fit it with a family, or remove it from families."
                    )
                self.enumerated.append(name)
                continue
            fn = site["fn"]
            support = fn.support
            allowed = allowed_families(support)
            if name in self.families:
                fam = self.families[name]
                if fam not in allowed:
                    raise ValueError(
                        f"families[{name!r}] = {fam!r} does not fit site {name!r} with support {support}; "
                        f"allowed: {list(allowed) or 'none'}."
                    )
            else:
                fam = default_family(support)
                if fam is None:
                    hint = (
                        f"override it with families={{{name!r}: 'normal'}} (a Gaussian on the unconstrained value)"
                        if not support.is_discrete
                        else "discrete latents need support boolean or integer_interval(0, K-1); "
                        "marginalise it out of the model or give it such a support"
                    )
                    raise ValueError(
                        f"ExpFamilyGuide has no family for site {name!r} with support {support}: {hint}."
                    )
            value = site["value"]
            for f in site["cond_indep_stack"]:
                self.plates[f.name] = (f.size, f.dim)
            self.sites[name] = dict(
                family=fam,
                shape=jnp.shape(value),
                event_dim=fn.event_dim,
                frames=[f.name for f in site["cond_indep_stack"]],
                support=support,
                dtype=jnp.result_type(value),
                init=self._init_params(name, fam, fn, value, support),
            )

    def _init_params(self, name, fam, fn, value, support):
        shape = jnp.shape(value)
        dtype = jnp.result_type(float)
        try:
            center = jnp.broadcast_to(fn.mean, shape).astype(dtype)
            if not bool(jnp.all(jnp.isfinite(center)) & jnp.all(support(center))):
                raise ValueError
        except Exception:  # noqa: BLE001 - no finite mean: use the prior draw
            center = jnp.asarray(value, dtype)
        c = 1.0 / self.init_scale**2
        if fam == "normal":
            return {"loc": biject_to(support).inv(center), "scale": jnp.full(shape, self.init_scale, dtype)}
        if fam == "gamma":
            return {"concentration": jnp.full(shape, c, dtype), "rate": c / center}
        if fam == "beta":
            return {"concentration1": c * center, "concentration0": c * (1.0 - center)}
        if fam == "dirichlet":
            return {"concentration": c * center}
        if fam == "bernoulli":
            return {"logits": jnp.zeros(shape, dtype)}
        k = _num_categories(_base_support(support)) if default_family(support) == "categorical" else 2
        return {"logits": jnp.zeros(shape + (k,), dtype)}

    def _param_name(self, site, fam, p):
        return f"{site}_{self.prefix}_{fam}_{p}"

    # -- distributions ----------------------------------------------------------------------
    def _dist(self, name, values):
        """The guide distribution of site ``name`` from its user parameters ``values`` (dict)."""
        info = self.sites[name]
        fam, event_dim = info["family"], info["event_dim"]
        if fam == "normal":
            base = dist.Normal(values["loc"], values["scale"])
            base = base.to_event(event_dim) if event_dim else base
            t = biject_to(info["support"])
            return base if _base_support(info["support"]) is constraints.real else dist.TransformedDistribution(base, t)
        if fam == "gamma":
            d = dist.Gamma(values["concentration"], values["rate"])
        elif fam == "beta":
            d = dist.Beta(values["concentration1"], values["concentration0"])
        elif fam == "dirichlet":
            d = dist.Dirichlet(values["concentration"])
            event_dim -= 1
        elif fam == "bernoulli":
            d = dist.Bernoulli(logits=values["logits"])
        else:
            d = dist.Categorical(logits=values["logits"])
        return d.to_event(event_dim) if event_dim > 0 else d

    def _values(self, name, params):
        info = self.sites[name]
        fam = info["family"]
        return {p: params[self._param_name(name, fam, p)] for p in EXPFAM_PARAMS[fam]}

    # -- the guide ----------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if self.sites is None:
            self._setup_prototype(*args, **kwargs)
        plates = {n: numpyro.plate(n, size, dim=dim) for n, (size, dim) in self.plates.items()}
        result = {}
        for name, info in self.sites.items():
            fam = info["family"]
            values = {}
            for p in EXPFAM_PARAMS[fam]:
                init = info["init"][p]
                if fam == "normal":
                    constraint = constraints.softplus_positive if p == "scale" else constraints.real
                else:
                    constraint = expfam_blocks.PARAM_CONSTRAINT[fam]
                values[p] = numpyro.param(self._param_name(name, fam, p), init, constraint=constraint)
            with ExitStack() as stack:
                for f in info["frames"]:
                    stack.enter_context(plates[f])
                d = self._dist(name, values)
                if fam in expfam_blocks.DISCRETE:
                    result[name] = self._sample_discrete(name, info, d, values["logits"])
                else:
                    result[name] = numpyro.sample(name, d)
        return result

    def _sample_discrete(self, name, info, d, logits):
        """Draw the site; while nb.BLR estimates its gradient, one element (enumeration) or the whole
        site (score-function draws) is set to a given value."""
        key = numpyro.prng_key()
        if key is None:
            return numpyro.sample(name, d)
        value = d.sample(key).astype(info["dtype"])
        forced = expfam_blocks.forced_value(self._param_name(name, info["family"], "logits"))
        if forced is not None:
            idx, v = forced
            if idx is None:  # the whole site (score-function draws)
                value = jnp.broadcast_to(jnp.asarray(v, value.dtype), value.shape)
            else:  # one element (enumeration)
                value = value.reshape(-1).at[idx].set(jnp.asarray(v, value.dtype)).reshape(value.shape)
        with handlers.substitute(data={name: value}):
            return numpyro.sample(name, d)

    # -- accessors ----------------------------------------------------------------------------
    def _check(self):
        if self.sites is None:
            raise RuntimeError("ExpFamilyGuide is not set up yet: run SVI.init (or call the guide once) first.")

    def get_posterior(self, params):
        """``{site: numpyro distribution}`` of the fitted guide (``params`` from ``svi.get_params``)."""
        self._check()
        return {name: self._dist(name, self._values(name, params)) for name in self.sites}

    def sample_posterior(self, rng_key, params, *args, sample_shape=(), **kwargs):
        """Draws ``{site: array of shape sample_shape + site shape}`` from the guide."""
        self._check()
        post = self.get_posterior(params)
        keys = jax.random.split(rng_key, len(post))
        return {
            name: d.sample(k, tuple(sample_shape)).astype(self.sites[name]["dtype"])
            for k, (name, d) in zip(keys, post.items())
        }

    def mean(self, params):
        """Posterior means (for a ``"normal"`` site on a constrained support: the transformed loc)."""
        self._check()
        out = {}
        for name, d in self.get_posterior(params).items():
            fam = self.sites[name]["family"]
            v = self._values(name, params)
            if fam == "normal":
                out[name] = biject_to(self.sites[name]["support"])(v["loc"])
            elif fam == "categorical":
                out[name] = jnp.sum(jax.nn.softmax(v["logits"], -1) * jnp.arange(v["logits"].shape[-1]), -1)
            elif fam == "bernoulli":
                out[name] = jax.nn.sigmoid(v["logits"])
            else:
                out[name] = d.mean
        return out

    def median(self, params):
        """A central value per site, in the site's support: the median for ``"normal"`` sites
        (transformed loc), the mean for Gamma / Beta / Dirichlet, the most probable value for
        Bernoulli / Categorical sites."""
        self._check()
        out = self.mean(params)
        for name, info in self.sites.items():
            v = self._values(name, params)
            if info["family"] == "bernoulli":
                out[name] = (v["logits"] > 0).astype(info["dtype"])
            elif info["family"] == "categorical":
                out[name] = jnp.argmax(v["logits"], -1).astype(info["dtype"])
        return out

    def quantiles(self, params, quantiles):
        raise NotImplementedError("ExpFamilyGuide.quantiles is not implemented; use sample_posterior.")

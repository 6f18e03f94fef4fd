r"""``ExpFamilyGuide``: a mean-field guide with an exponential family per latent site, chosen by support.

Which family a support gets, the guide parameters (``{site}_{prefix}_{family}_{param}``), their
constraints and the guide's distributions are read from :mod:`numpyro_blr.families.registry`:
real -> ``"normal"``, positive -> ``"gamma"``, unit_interval -> ``"beta"``, simplex ->
``"dirichlet"``, boolean -> ``"bernoulli"``, integer_interval(0, K-1) -> ``"categorical"``.
``families={"site": "normal"}`` overrides the choice; ``"normal"`` fits any continuous support
(a Gaussian on the unconstrained value, mapped through ``biject_to(support)``, as ``AutoNormal``),
``"categorical"`` also fits a boolean site. ``nb.BLR`` reads these names (see
:mod:`numpyro_blr.layout`): Normal sites get the Gaussian BLR, the others the family's BLR step
(:mod:`numpyro_blr.expfam_blocks`); discrete sites are enumerated element by element inside the
optimizer (:mod:`numpyro_blr.estimators.discrete`), so their gradient has no score-function noise.

Continuous non-Gaussian sites are drawn with NumPyro's implicitly reparameterised samplers (Gamma,
Beta, Dirichlet), and their log density is evaluated with the parameters under ``stop_gradient``
(:class:`~numpyro_blr.estimators.implicit.PathDerivative`): the same draws and loss, and a gradient without
the score term of :math:`\log q` (the path derivative, Roeder et al. 2017), exact at the BLR's fixed point
on a conjugate site. Discrete sites are drawn exactly; with an optimizer other than ``nb.BLR`` their
parameters get ``Trace_ELBO``'s (not useful) gradient, so use ``nb.BLR``.
"""

import warnings
from contextlib import ExitStack

import jax
import jax.numpy as jnp
import numpyro
import numpyro.distributions as dist
from jax import lax
from numpyro import handlers
from numpyro.distributions import constraints
from numpyro.distributions.transforms import biject_to
from numpyro.infer.initialization import init_to_uniform

from numpyro_blr.estimators.discrete import MAX_ENUMERATE, SCORE_SAMPLES
from numpyro_blr.estimators.implicit import PathDerivative
from numpyro_blr.families.registry import FAMILIES, GUIDE_FAMILIES, allowed_families, base_support, default_family, num_categories


#: the families whose guide site draws with the live parameters and evaluates log q with stopped ones
#: (:class:`~numpyro_blr.estimators.implicit.PathDerivative`): SVI's gradient is then the path derivative
PATH_DERIVATIVE_FAMILIES = ("gamma", "beta", "dirichlet")


def _value_for_improper(site):
    """A value for a sample site whose prior cannot be sampled (``ImproperUniform``), else None."""
    if site.get("type") != "sample" or site.get("is_observed") or "fn" not in site:
        return None
    fn = site["fn"]
    while hasattr(fn, "base_dist"):
        fn = fn.base_dist
    if isinstance(fn, dist.ImproperUniform):
        return init_to_uniform(site)
    return None


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

    def __init__(self, model, families=None, init_scale=0.1, prefix="blr", max_enumerate=MAX_ENUMERATE,
                 score_samples=SCORE_SAMPLES):
        if not (isinstance(init_scale, (int, float)) and init_scale > 0):
            raise ValueError(f"init_scale must be a positive float, got {init_scale!r}.")
        families = dict(families or {})
        for site, fam in families.items():
            if fam not in GUIDE_FAMILIES:
                raise ValueError(f"families[{site!r}] = {fam!r} is not one of {sorted(GUIDE_FAMILIES)}.")
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
        # an improper prior (ImproperUniform: a flat prior) cannot be sampled; its site gets a value as
        # NumPyro's autoguides give it (init_to_uniform), and its "normal" family is centred there
        with handlers.block(), handlers.trace() as tr, handlers.substitute(substitute_fn=_value_for_improper), \
                handlers.seed(rng_seed=key):
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
                # a continuous support without its own family (interval(2, 5), greater_than(1), ...)
                # gets a Gaussian on the unconstrained value, as AutoNormal gives every site
                fam = default_family(support) or (None if support.is_discrete else "normal")
                if fam is None:
                    raise ValueError(
                        f"ExpFamilyGuide has no family for discrete site {name!r} with support {support}: discrete "
                        "latents need support boolean or integer_interval(0, K-1); marginalise it out of the "
                        "model or give it such a support."
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
        if fam == "normal":  # on the unconstrained value, whose shape may differ (corr_cholesky: (d, d) -> (d(d-1)/2,))
            loc = biject_to(support).inv(center)
            return {"loc": loc, "scale": jnp.full(jnp.shape(loc), self.init_scale, dtype)}
        if fam == "gamma":
            return {"concentration": jnp.full(shape, c, dtype), "rate": c / center}
        if fam == "beta":
            return {"concentration1": c * center, "concentration0": c * (1.0 - center)}
        if fam == "dirichlet":
            return {"concentration": c * center}
        if fam == "bernoulli":
            return {"logits": jnp.zeros(shape, dtype)}
        return {"logits": jnp.zeros(shape + (num_categories(support),), dtype)}

    def _param_name(self, site, fam, p):
        return f"{site}_{self.prefix}_{fam}_{p}"

    # -- distributions ----------------------------------------------------------------------
    def _dist(self, name, values):
        """The guide distribution of site ``name`` from its user parameters ``values`` (dict)."""
        info = self.sites[name]
        fam, event_dim = FAMILIES[info["family"]], info["event_dim"]
        d = fam.distribution(*[values[p] for p in fam.params])
        if fam.name == "normal" and base_support(info["support"]) is not constraints.real:
            t = biject_to(info["support"])  # its domain's event dims replace the codomain's in the site's event
            d = dist.TransformedDistribution(d.to_event(t.domain.event_dim + event_dim - t.codomain.event_dim), t)
            event_dim = 0
        return d.to_event(event_dim - fam.event_dim)

    def _values(self, name, params):
        fam = self.sites[name]["family"]
        return {p: params[self._param_name(name, fam, p)] for p in FAMILIES[fam].params}

    # -- the guide ----------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if self.sites is None:
            self._setup_prototype(*args, **kwargs)
        plates = {n: numpyro.plate(n, size, dim=dim) for n, (size, dim) in self.plates.items()}
        result = {}
        for name, info in self.sites.items():
            fam = FAMILIES[info["family"]]
            values = {
                p: numpyro.param(self._param_name(name, fam.name, p), info["init"][p], constraint=c)
                for p, c in zip(fam.params, fam.constraints)
            }
            with ExitStack() as stack:
                for f in info["frames"]:
                    stack.enter_context(plates[f])
                # a discrete site is drawn from its logits: nb.BLR sets a value by setting the logits
                # (numpyro_blr.estimators.discrete), no state outside the parameters
                d = self._dist(name, values)
                if fam.name in PATH_DERIVATIVE_FAMILIES:  # the same draw; log q without its score term
                    d = PathDerivative(d, self._dist(name, jax.tree.map(lax.stop_gradient, values)))
                result[name] = numpyro.sample(name, d)
        return result

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
            elif fam == "categorical":  # NumPyro's Categorical has no mean
                out[name] = jnp.sum(jax.nn.softmax(v["logits"], -1) * jnp.arange(v["logits"].shape[-1]), -1)
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

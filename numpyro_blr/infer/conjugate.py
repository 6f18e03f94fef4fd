r"""Exact conjugate updates and VMP sweeps in one call: :func:`conjugate_fit`, a thin wrapper of :func:`~.vmp.vmp`.

The Bayesian learning rule (Khan & Rue 2023) for a posterior family with natural parameters
:math:`\lambda` and expectation parameters :math:`\mu` is
:math:`\lambda \leftarrow (1 - \rho)\,\lambda + \rho\,\nabla_\mu \mathbb E_q[\log p(y, z)]`.
When the log joint is *linear* in a site's sufficient statistics given the other sites (its complete
conditional is in the family of :math:`q_i`), :math:`\nabla_{\mu_i}\mathbb E_q[\log p]` is the expected natural
parameter of the complete conditional; one step with :math:`\rho = 1` gives the exact posterior of a conjugate
model, and sweeps over the sites are variational message passing (Winn & Bishop 2005). How the messages are
read off the model's log density (quadrature rules exact for each family's statistics, autodiff through them,
plates vectorised) is in :mod:`numpyro_blr.infer.expectations`; the algorithm with ``init``/``step``/``run`` is
:func:`numpyro_blr.infer.vmp`.

Until issue 13 this module had its own engine (barycentric interpolation in the statistics over anchors that grew
with the data: a sweep cost :math:`O(N^2)`); :func:`conjugate_fit` keeps its signature and results on the new one.
"""

from dataclasses import dataclass
from typing import Any, Dict, List

import jax.numpy as jnp
import numpyro.distributions as dist

from numpyro_blr.families import FullGaussian
from numpyro_blr.infer.graph import NonConjugateError
from numpyro_blr.infer.vmp import vmp

__all__ = ["ConjugateResult", "NonConjugateError", "conjugate_fit"]


@dataclass
class ConjugateResult:
    r"""Output of :func:`conjugate_fit`.

    ``posterior``        dict site -> NumPyro distribution over the whole site (a single-element Gaussian site:
                         a ``Normal`` for scalars, else a ``MultivariateNormal`` over the flattened value; a site in
                         plates: a batch over its elements);
    ``natural_params``   dict site -> the family's natural-parameter NamedTuple (element layout);
    ``elbo``             the exact ELBO after the last step (the log evidence after one step of a conjugate model);
    ``elbo_history``     the ELBO after every step;
    ``factors``          dict factor -> the latent sites it depends on;
    ``expected_log_factors`` / ``entropies``: the ELBO's terms.
    """

    posterior: Dict[str, Any]
    natural_params: Dict[str, Any]
    elbo: float
    elbo_history: List[float]
    factors: Dict[str, tuple]
    expected_log_factors: Dict[str, float]
    entropies: Dict[str, float]


def conjugate_fit(model, *args, num_steps=1, lr=1.0, seed=0, rtol=None, init=None, check=True, **kwargs):
    r"""Fit a mean-field exponential-family posterior with ``num_steps`` exact BLR sweeps (conjugate updates / VMP).

    For every latent site :math:`i` (in trace order, Gauss–Seidel) each step sets
    :math:`\lambda_i \leftarrow (1-\rho)\lambda_i + \rho\,\nabla_{\mu_i}\mathbb E_q[\log p(y, z)]`. With
    ``num_steps=1`` and ``lr=1`` a model with one conjugate latent block gets its exact posterior and ``elbo``
    equals the log evidence; models with several blocks (Normal mean x Gamma precision) need several steps.

    Args:
        model: a NumPyro model; ``*args``/``**kwargs`` are passed to it. Every unobserved sample site must have a
            prior from: Normal (any shape; a dense-precision Gaussian per plate element over its other axes),
            MultivariateNormal, Gamma/Exponential, Beta, Dirichlet, Bernoulli, Categorical.
        num_steps: number of sweeps over the sites.
        lr: the BLR step size :math:`\rho \in (0, 1]`.
        seed: unused (the checks' random values are seeded); kept for compatibility.
        rtol: tolerance of the conjugacy check (default ``1e-6`` in float64, ``1e-3`` in float32).
        init: optional dict site -> distribution to start from, e.g. ``result.posterior`` of an earlier fit.
        check: whether to check conjugacy.

    Returns:
        :class:`ConjugateResult`. For a fit with a convergence tolerance, a progress bar or minibatches, use
        :func:`numpyro_blr.infer.vmp` / :func:`numpyro_blr.infer.svi`.

    Raises:
        NonConjugateError: naming the site (and its family and support) whose prior has no family here, or whose
            complete conditional is not in its prior's family (and the factor that breaks it).
    """
    del seed
    if not 0.0 < lr <= 1.0:
        raise ValueError(f"conjugate_fit: lr must be in (0, 1], got {lr}")
    algo = vmp(model, *args, lr=lr, check=check, rtol=rtol, **kwargs)
    graph = algo.graph
    init = {n: _as_site_dist(graph.sites[n], d) for n, d in (init or {}).items()}
    state = algo.init(init=init)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        res = algo.run(state, num_steps=num_steps, tol=None, progress_bar=False)
    if res.diverged:
        name = res.diverged.split("'")[1] if "'" in res.diverged else None
        what = graph.sites[name].describe() if name in graph.sites else res.diverged
        raise NonConjugateError(f"{what}: the expected natural parameters of its complete conditional do not define a "
                                "proper distribution (improper model?)")
    posterior = {}
    for n, s in graph.sites.items():
        nat = res.state.natural[n]
        if s.kind == "gaussian" and s.elem_shape == ():
            mean, precision = FullGaussian.from_natural(nat)
            posterior[n] = (dist.Normal(mean[0], 1.0 / jnp.sqrt(precision[0, 0])) if s.value_shape == ()
                            else FullGaussian.to_numpyro(mean, precision))
        else:
            posterior[n] = res.posterior[n]
    return ConjugateResult(
        posterior=posterior,
        natural_params=dict(res.state.natural),
        elbo=res.elbo_history[-1],
        elbo_history=res.elbo_history,
        factors={f: fac.deps for f, fac in graph.factors.items()},
        expected_log_factors=res.expected_log_factors,
        entropies=res.entropies,
    )


def _as_site_dist(site, d):
    """A single-element Gaussian site's posterior (``Normal``/``MultivariateNormal`` over the flattened value) as a
    distribution over its value, for ``init``."""
    if site.kind == "gaussian" and site.elem_shape == () and isinstance(d, dist.MultivariateNormal) and site.value_shape != (site.block_size,):
        return dist.MultivariateNormal(d.loc, precision_matrix=d.precision_matrix)
    return d

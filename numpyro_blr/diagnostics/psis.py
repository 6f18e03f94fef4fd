r"""Is the fit trustworthy? Pareto-smoothed importance sampling for variational posteriors.

With draws :math:`\theta^{(s)} \sim q(\theta)` the log importance ratios

.. math::
    \log r_s = \log p(\theta^{(s)}, y) - \log q(\theta^{(s)})

tell how far :math:`q` is from the posterior :math:`p(\theta \mid y) \propto p(\theta, y)`. Yao,
Vehtari, Simpson & Gelman (2018), *Yes, but did it work?: Evaluating variational inference* (ICML),
fit a generalised Pareto distribution to the largest ratios (Pareto-smoothed importance sampling,
Vehtari et al. 2024, JMLR) and read the fit off its shape :math:`\hat k`:

* :math:`\hat k < 0.5`: good, :math:`q` is close to the posterior; the importance-weighted
  estimates have finite variance;
* :math:`0.5 \le \hat k \le 0.7`: ok, usable; PSIS corrects the expectations;
* :math:`\hat k > 0.7`: unreliable, the fit should not be trusted (nor its PSIS correction).

The ratio does not depend on the parameterisation as long as both densities are in the same space.
Here both are in the unconstrained space :math:`u = T^{-1}(\theta)` the guide works in:

.. math::
    \log p(u, y) = \log p(T(u), y) + \log\lvert\det J_T(u)\rvert, \qquad
    \log q(u) = \text{the guide's Gaussian (or flow) density of } u,

i.e. minus NumPyro's potential energy and the density of the guide's latent.

The same ratios give the LOO-CV for an approximate posterior (Magnusson, Andersen, Jonasson &
Vehtari 2019, ICML): :func:`loo_vi` calls ``arviz.loo_approximate_posterior``, which uses the
importance ratios :math:`r_s\,/\,p(y_i \mid \theta^{(s)})` for each left-out point :math:`i`.
"""

from typing import NamedTuple

import jax
import numpy as np
import xarray as xr
from arviz_stats.base import array_stats

from numpyro_blr.diagnostics.draws import (  # noqa: F401
    DiagnosticsError,
    check_arguments,
    guide_draws,
    guide_program,
    has_density,
    log_densities,
)

__all__ = [
    "PSISResult",
    "check_fit",
    "check_guide",
    "has_density",
    "khat_verdict",
    "log_densities",
    "loo_vi",
    "psis",
    "psis_expectation",
]

GOOD_K = 0.5
OK_K = 0.7
TAIL_ONLY_ESS = 0.9  # PSISResult.tail_only: an unreliable k-hat with at least this fraction of ESS


def khat_verdict(khat):
    r"""The verdict in words for a Pareto :math:`\hat k` (Yao et al. 2018; Vehtari et al. 2024).

    ``"good"`` (:math:`\hat k < 0.5`), ``"ok"`` (:math:`0.5 \le \hat k \le 0.7`) or
    ``"unreliable"`` (:math:`\hat k > 0.7`, or nan). :math:`-\infty` (constant ratios, :math:`q = p`) is good.
    """
    k = float(khat)
    if np.isnan(k) or k > OK_K:
        return "unreliable"
    return "good" if k < GOOD_K else "ok"


class PSISResult(NamedTuple):
    """Pareto-smoothed importance sampling of :math:`p(\\theta\\mid y)` with proposal :math:`q`.

    ``khat``          Pareto shape of the largest importance ratios;
    ``verdict``       ``"good"``/``"ok"``/``"unreliable"`` (see :func:`khat_verdict`);
    ``log_weights``   normalised PSIS log weights (``logsumexp == 0``), shape ``(S,)``;
    ``ess``           effective sample size :math:`1/\\sum_s w_s^2` of the smoothed weights;
    ``log_ratio``     raw :math:`\\log p(\\theta^{(s)}, y) - \\log q(\\theta^{(s)})`;
    ``log_p``, ``log_q`` the two densities per draw.
    """

    khat: float
    verdict: str
    log_weights: np.ndarray
    ess: float
    log_ratio: np.ndarray
    log_p: np.ndarray
    log_q: np.ndarray

    @property
    def tail_only(self):
        """k-hat says unreliable while the smoothed weights are nearly uniform (ESS >= 90% of the draws):
        q matches the posterior's bulk, and k-hat reads a far tail of the ratios (see docs/diagnostics.md)."""
        return self.verdict == "unreliable" and self.ess >= TAIL_ONLY_ESS * self.log_ratio.size

    def __str__(self):
        text = f"Pareto k-hat = {self.khat:.2f} ({self.verdict}); PSIS ESS = {self.ess:.0f} of {self.log_ratio.size}"
        if self.tail_only:
            text += (
                "; the weights are nearly uniform: q matches the posterior's bulk and k-hat reads a far tail "
                "(heavier than q's) that importance sampling reaches only with many more draws; moments of q are "
                "usable, tail probabilities and PSIS corrections of heavy-tailed quantities are not"
            )
        return text


# -- PSIS --------------------------------------------------------------------------------------
def psis(log_p, log_q, r_eff=1.0):
    r"""Pareto-smoothed importance sampling with ratios :math:`r_s = p(\theta^{(s)}, y)/q(\theta^{(s)})`.

    Uses ArviZ's PSIS (``arviz_stats``; Vehtari, Simpson, Gelman, Yao & Gabry 2024, *Pareto smoothed
    importance sampling*, JMLR): the largest :math:`M = \min(S/5, 3\sqrt{S})` ratios are replaced by
    quantiles of a fitted generalised Pareto distribution whose shape is :math:`\hat k`. ArviZ 1.x's
    ``psislw`` takes *minus* the log ratios, which is what is passed here. Returns a
    :class:`PSISResult` whose ``verdict`` follows Yao et al. (2018): good below 0.5, ok up to 0.7,
    unreliable above.
    """
    log_p = np.asarray(log_p, dtype=np.float64).reshape(-1)
    log_q = np.asarray(log_q, dtype=np.float64).reshape(-1)
    if log_p.shape != log_q.shape:
        raise ValueError(f"log_p has {log_p.size} draws but log_q has {log_q.size}.")
    log_ratio = log_p - log_q
    if not np.all(np.isfinite(log_ratio)):
        bad = int(np.sum(~np.isfinite(log_ratio)))
        raise ValueError(f"{bad} of {log_ratio.size} log importance ratios are not finite (log p or log q is -inf/nan).")
    S = log_ratio.size
    if np.ptp(log_ratio) <= 1e-9 * max(1.0, float(np.max(np.abs(log_ratio)))):
        # constant ratios: q equals the posterior up to rounding; the Pareto fit is degenerate (k -> -inf)
        lw = np.full(S, -np.log(S))
        return PSISResult(-np.inf, "good", lw, float(S), log_ratio, log_p, log_q)
    # shift for numerical safety; PSIS is invariant to a constant
    lw, khat = array_stats.psislw(-(log_ratio - log_ratio.max()), r_eff=r_eff, axis=-1)
    lw = np.asarray(lw, dtype=np.float64)
    lw = lw - _logsumexp(lw)
    khat = float(khat)
    ess = float(1.0 / np.sum(np.exp(2 * lw)))
    return PSISResult(khat, khat_verdict(khat), lw, ess, log_ratio, log_p, log_q)


def _logsumexp(x):
    m = np.max(x)
    return m + np.log(np.sum(np.exp(x - m)))


def _sample_stats(tree):
    if not hasattr(tree, "children"):

        raise DiagnosticsError(
            f"expected the xarray.DataTree that numpyro_blr.diagnostics.to_datatree returns, got {type(tree).__name__}"
            + ("; for a guide use check_guide(guide, svi_result.params, model, *args)." if callable(tree) else ".")
        )
    if "sample_stats" not in tree.children or "log_p" not in tree["sample_stats"].ds:
        raise ValueError(
            "the tree has no sample_stats/log_p and log_q: build it with "
            "numpyro_blr.diagnostics.to_datatree(..., importance=True) from a guide with a density."
        )
    ss = tree["sample_stats"].ds
    return ss["log_p"], ss["log_q"]


def check_fit(tree):
    r"""Pareto :math:`\hat k` of the fit stored in ``tree`` (from :func:`~numpyro_blr.diagnostics.to_datatree`).

    Reads :math:`\log p(\theta^{(s)}, y)` and :math:`\log q(\theta^{(s)})` of the posterior draws from
    ``sample_stats`` and returns :func:`psis` of them (Yao et al. 2018).
    """
    log_p, log_q = _sample_stats(tree)
    return psis(log_p.values, log_q.values)


def check_guide(guide, params, model, *args, num_samples=4000, rng_key=None, **kwargs):
    r"""Pareto :math:`\hat k` of a fitted guide: draw :math:`S` = ``num_samples`` from :math:`q`, then :func:`psis`.

    :math:`\hat k` is an estimate from the largest :math:`\min(S/5, 3\sqrt S)` ratios: with
    :math:`S = 1000` it is noisy (a Gaussian fit of a logistic-regression posterior, whose log ratio
    has a small cubic term, gives 0.6-1.0 at S = 1000 and 0.1-0.3 at S = 4000), hence the default
    S = 4000.

    The draws are ``guide.sample_posterior(rng_key, params, sample_shape=(S,))``; the densities come
    from :func:`log_densities`. Compare with NumPyro's own ``numpyro.infer.psis_diagnostic`` (same
    statistic, different draws and tail fit) and, for calibration across simulated data sets, its
    ``numpyro.infer.calibration.vsbc_diagnostic`` (Yao et al. 2018, Sec. 3).
    """

    check_arguments("check_guide", guide, params, model, args, kwargs)
    rng_key = jax.random.PRNGKey(0) if rng_key is None else rng_key

    def compute(args, kwargs, inputs, meta):
        params, rng_key = inputs
        draws = guide_draws(guide, params, args, kwargs, num_samples, rng_key)
        return log_densities(guide, params, model, draws, *args, **kwargs)

    (log_p, log_q), _ = guide_program(compute, ("check_guide", num_samples), guide, model, params, args, kwargs, rng_key)
    return psis(np.asarray(log_p), np.asarray(log_q))


def psis_expectation(tree, var_names=None, result=None):
    r"""PSIS-corrected posterior means and sds: :math:`\mathbb{E}_p[f] \approx \sum_s w_s f(\theta^{(s)})`.

    :math:`w_s` are the normalised Pareto-smoothed weights of :func:`check_fit` (or ``result``).
    Returns an ``xarray.Dataset`` with dim ``stat`` = ``["mean", "sd"]`` per posterior variable.
    Trust it when :math:`\hat k \le 0.7` (Yao et al. 2018, Sec. 2.2).
    """
    result = check_fit(tree) if result is None else result
    post = tree["posterior"].ds
    names = list(post.data_vars) if var_names is None else list(var_names)
    w = xr.DataArray(np.exp(result.log_weights).reshape(1, -1), dims=("chain", "draw"))
    out = {}
    for name in names:
        x = post[name].astype(float)
        mean = (w * x).sum(("chain", "draw"))
        var = (w * (x - mean) ** 2).sum(("chain", "draw"))
        out[name] = xr.concat([mean, np.sqrt(var)], dim="stat")
    return xr.Dataset(out).assign_coords(stat=["mean", "sd"])


def loo_vi(tree, pointwise=True, var_name=None):
    r"""PSIS-LOO-CV corrected for an approximate posterior (Magnusson et al. 2019).

    With draws from :math:`q` instead of :math:`p(\theta\mid y)`, the leave-one-out weights are
    :math:`w^{(s)}_i \propto \frac{p(\theta^{(s)}, y)}{q(\theta^{(s)})\,p(y_i\mid\theta^{(s)})}`;
    ``arviz.loo_approximate_posterior(tree, log_p, log_q)`` Pareto-smooths them per observation.
    ``log_p`` and ``log_q`` are read from ``sample_stats`` (see :func:`to_datatree`).
    """
    from arviz_stats import loo_approximate_posterior

    log_p, log_q = _sample_stats(tree)
    return loo_approximate_posterior(tree, log_p=log_p, log_q=log_q, pointwise=pointwise, var_name=var_name)

"""nb.LieGroupGuide + nb.LieGroupBLR() with their defaults (issue 25): the mean-field optimum without tuning, and a
fit that diverges, stalls or is too short says so."""

import math
import warnings

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.infer import SVI, Trace_ELBO
from numpyro.infer.autoguide import AutoNormal

import numpyro_blr as nb


def _uncentred_regression(n=40, seed=0):
    """kidiq's geometry in small: an uncentred predictor (mean 100, sd 15), so intercept and slope have posterior
    correlation about -0.99, and an unknown noise scale."""
    rng = np.random.default_rng(seed)
    x = 100.0 + 15.0 * rng.standard_normal(n)
    y = 20.0 + 0.6 * x + 5.0 * rng.standard_normal(n)
    return x, y


def _model(x, y=None):
    beta = numpyro.sample("beta", dist.Normal(0.0, 100.0).expand([2]).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfNormal(20.0))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Normal(beta[0] + beta[1] * x, sigma), obs=y)


def _elbo(guide, params, x, y, n=4000):
    """ELBO and its Monte Carlo standard error, n draws from a fixed key (the same for every guide)."""
    losses = jax.vmap(lambda k: Trace_ELBO().loss(k, params, _model, guide, x, y))(jax.random.split(jax.random.PRNGKey(7), n))
    losses = np.asarray(losses, np.float64)
    return -losses.mean(), losses.std() / math.sqrt(n)


def _run(guide, optim, steps, x, y, key=0):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = SVI(_model, guide, optim, Trace_ELBO()).run(jax.random.PRNGKey(key), steps, x, y, progress_bar=False)
    return result, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


@pytest.mark.slow
def test_defaults_reach_the_mean_field_optimum():
    """LieGroupGuide + LieGroupBLR() (no lr) on an uncentred regression with unknown noise reaches the ELBO of
    nb.BLR() + AutoNormal (the mean-field Gaussian optimum) within 1 nat (the issue's target; the two ELBO estimates'
    Monte Carlo error, 4000 draws each, is added), and sigma's median is within 5% of that optimum's, with no
    warning. Before: LieGroupBLR had no default lr; with the documented lr=0.05 this fit ends ~1e4 nat short
    (a diagonal Jacobi step along a -0.99 correlation, no averaging)."""
    x, y = _uncentred_regression()
    lie = nb.LieGroupGuide(_model)
    result, warned = _run(lie, nb.LieGroupBLR(), 1000, x, y)
    assert warned == []
    # the positive site is the lognormal of AutoNormal (the affine group on log sigma), with a free spread
    assert {"sigma_lie_loc", "sigma_lie_scale"} <= set(result.params)
    ref = AutoNormal(_model)
    ref_result, _ = _run(ref, nb.BLR(), 1000, x, y)
    (e_lie, se_lie), (e_ref, se_ref) = _elbo(lie, result.params, x, y), _elbo(ref, ref_result.params, x, y)
    assert e_ref - e_lie < 1.0 + 3 * math.hypot(se_lie, se_ref), (e_lie, e_ref)
    ratio = float(lie.median(result.params)["sigma"]) / float(ref.median(ref_result.params)["sigma"])
    assert abs(ratio - 1) < 0.05, ratio


@pytest.mark.slow
def test_a_stalled_fit_says_so():
    """A step size far too small for the run: the means are still travelling at the end, and the warning names the
    site (before: no warning)."""
    x, y = _uncentred_regression()
    guide = nb.LieGroupGuide(_model)
    _, warned = _run(guide, nb.LieGroupBLR(1e-4), 30, x, y)
    assert any("has not converged" in w and "'beta'" in w for w in warned), warned


@pytest.mark.slow
def test_a_diverging_fit_says_so():
    """lr = 1.5 without backtracking on the diagonal step: along the -0.99 correlation the step's Jacobi iteration
    multiplies the error by |1 - 1.5 * 1.99| ~ 2 per step and the loss overflows within a few steps: the report says
    the fit diverged or is not usable, and what to change (before: only that steps were skipped)."""
    x, y = _uncentred_regression()
    guide = nb.LieGroupGuide(_model)
    _, warned = _run(guide, nb.LieGroupBLR(1.5, backtrack=False, joint_mean=False), 30, x, y)
    assert any(("nb.LieGroupBLR diverged" in w or "not usable" in w) and "smaller lr (this run used 1.5)" in w
               for w in warned), warned


@pytest.mark.slow
def test_a_short_run_is_too_short_to_judge():
    x, y = _uncentred_regression()
    guide = nb.LieGroupGuide(_model)
    _, warned = _run(guide, nb.LieGroupBLR(), 5, x, y)
    assert any("too few to judge" in w for w in warned), warned


@pytest.mark.slow
def test_positive_sites_and_bad_arguments():
    """Positive sites: lognormal (affine on log) with the Gaussian default, the multiplicative group theta = g xi
    when a positive q0 is given; bad optimizer arguments are named."""
    x, y = _uncentred_regression(10)
    guide = nb.LieGroupGuide(_model, positive_base=dist.Gamma(10.0))
    svi = SVI(_model, guide, nb.LieGroupBLR(), Trace_ELBO())
    state = svi.init(jax.random.PRNGKey(0), x, y)
    params = svi.get_params(state)
    assert "sigma_lie_scale" in params and "sigma_lie_loc" not in params
    with pytest.raises(ValueError, match="backtrack"):
        nb.LieGroupBLR(backtrack="yes")
    with pytest.raises(ValueError, match="joint_mean"):
        nb.LieGroupBLR(joint_mean=1)

"""numpyro_blr.workflow: K-fold, exact LOO refits and SBC, against closed forms on a conjugate model, with a
negative control for SBC and errors that name the argument."""

import os
import sys
import warnings

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.infer import MCMC, NUTS
from numpyro.infer.autoguide import AutoNormal
from scipy.stats import norm

import numpyro_blr as nb
from numpyro_blr import workflow as wf
from numpyro_blr.workflow import WorkflowError, _ecdf_band
from conftest import count_compiles

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench"))
import robustness_cases as rc  # noqa: E402  (the suite's eight-schools models and data)

PRIOR_SD = 3.0


def normal_mean(y):
    """y_i ~ N(mu, 1), mu ~ N(0, PRIOR_SD^2): every posterior and predictive in closed form."""
    mu = numpyro.sample("mu", dist.Normal(0.0, PRIOR_SD))
    with numpyro.plate("n", y.shape[0]):
        numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)


def exact_heldout(y, train):
    """log p(y_i | y_train) for every i, given a boolean training mask."""
    prec = 1.0 / PRIOR_SD**2 + train.sum()
    m = y[train].sum() / prec
    return norm.logpdf(y, m, np.sqrt(1.0 / prec + 1.0)), m, 1.0 / prec


def mc_tolerance(y, heldout_moments, num_draws, fit_sd_error=0.05):
    """Allowance for log (1/S) sum_s p(y_i | mu_s) against its limit: 4 Monte Carlo sds (delta method:
    sd(p)/(mean(p) sqrt(S)) per observation, summed in quadrature), plus the effect of a fitted mean
    ``fit_sd_error`` posterior sds off in each fit (|d elpd_i / dm| = |y_i - m| / (v + 1))."""
    rng = np.random.default_rng(0)
    var, shift = 0.0, 0.0
    for yi, (m, v) in zip(y, heldout_moments):
        p = norm.pdf(yi, m + np.sqrt(v) * rng.standard_normal(20000), 1.0)
        var += (p.std() / p.mean()) ** 2 / num_draws
        shift += abs(yi - m) / (v + 1.0) * fit_sd_error * np.sqrt(v)
    return 4.0 * np.sqrt(var) + shift


@pytest.fixture(scope="module")
def observations():
    return np.random.default_rng(1).normal(1.0, 1.0, 24).astype(np.float32)


@pytest.mark.slow
def test_kfold_equals_the_closed_form(observations):
    y = observations
    k, folds = 4, np.arange(24) % 4
    res = wf.kfold(normal_mean, AutoNormal(normal_mean), y, k=k, folds=folds, num_steps=300, num_draws=2000)
    exact, moments = np.empty(24), [None] * 24
    for j in range(k):
        lp, m, v = exact_heldout(y, folds != j)
        exact[folds == j] = lp[folds == j]
        for i in np.flatnonzero(folds == j):
            moments[i] = (m, v)
    tol = mc_tolerance(y, moments, 2000)
    assert abs(res.elpd - exact.sum()) < tol, (res.elpd, exact.sum(), tol)
    np.testing.assert_allclose(np.asarray(res.elpd_i), exact, atol=tol)
    assert res.n_folds == k and res.n_data_points == 24
    assert np.isclose(res.se, np.sqrt(24 * np.var(np.asarray(res.elpd_i))))
    lp_full, m, v = exact_heldout(y, np.ones(24, bool))  # p = lpd of the full-data fit - elpd
    assert abs(res.p - (lp_full.sum() - exact.sum())) < 2 * tol


@pytest.mark.slow
def test_kfold_warm_start_agrees_with_cold_start_and_the_closed_form(observations):
    """Folds started from the full-data fit (100 steps each, one loop) against folds fitted from scratch (300 steps,
    vectorised) and against the closed form, within the Monte Carlo tolerance; likewise from a full-data fit given
    as result=."""
    y = observations
    k, folds = 4, np.arange(24) % 4
    guide = AutoNormal(normal_mean)
    cold = wf.kfold(normal_mean, guide, y, k=k, folds=folds, num_steps=300, num_draws=2000, warm_start=False)
    warm = wf.kfold(normal_mean, guide, y, k=k, folds=folds, num_steps=300, num_draws=2000, warm_start=True)
    full = nb.fit(normal_mean, guide, y, num_steps=300, progress_bar=False)
    given = wf.kfold(normal_mean, guide, y, k=k, folds=folds, num_steps=300, num_draws=2000, result=full)
    exact, moments = np.empty(24), [None] * 24
    for j in range(k):
        lp, m, v = exact_heldout(y, folds != j)
        exact[folds == j] = lp[folds == j]
        for i in np.flatnonzero(folds == j):
            moments[i] = (m, v)
    tol = mc_tolerance(y, moments, 2000)
    lp_full = exact_heldout(y, np.ones(24, bool))[0].sum()
    for res in (warm, given):
        assert abs(res.elpd - exact.sum()) < tol, (res.elpd, exact.sum(), tol)
        np.testing.assert_allclose(np.asarray(res.elpd_i), exact, atol=tol)
        assert abs(res.elpd - cold.elpd) < min(2 * tol, cold.se), (res.elpd, cold.elpd, tol, cold.se)
        assert abs(res.se - cold.se) < 0.05 * cold.se
        assert abs(res.p - (lp_full - exact.sum())) < 2 * tol


@pytest.mark.slow  # about 10 s: three programs, each compiled twice
def test_other_step_counts_run_the_same_programs(observations):
    """The step counts are arguments of the workflow's programs: K-fold's loop of warm starts, its vectorised fits
    from scratch, and SBC's fits run another num_steps or warm_steps without compiling, and give what a program
    built for those counts gives (the counts are honoured: the results differ from the first counts')."""
    from numpyro_blr import compile_once

    y, folds = observations, np.arange(24) % 4
    guide = AutoNormal(normal_mean)
    runs = {
        "kfold, warm starts": lambda n, w: wf.kfold(normal_mean, guide, y, k=4, folds=folds, num_steps=n, warm_steps=w,
                                                    num_draws=200, warm_start=True).elpd_i,
        "kfold, from scratch": lambda n, w: wf.kfold(normal_mean, guide, y, k=4, folds=folds, num_steps=n,
                                                     num_draws=200, warm_start=False).elpd_i,
        "sbc": lambda n, w: wf.sbc(normal_mean, guide, y[:8], num_datasets=6, num_draws=19, num_steps=n,
                                   rng_key=jax.random.PRNGKey(3)).ranks["mu"],
    }
    for what, run in runs.items():
        first = np.asarray(run(60, 30))
        with count_compiles() as c:
            other = np.asarray(run(25, 12))
        assert c["compile"] == 0, what
        compile_once.cache_clear()  # a program built for these counts
        np.testing.assert_allclose(other, np.asarray(run(25, 12)), rtol=1e-6, err_msg=what)
        if what != "sbc":  # ranks are coarse: 25 and 60 steps may rank alike
            assert not np.allclose(first, other, rtol=1e-6), what


@pytest.mark.slow
def test_kfold_warm_start_that_has_not_converged_is_flagged(observations):
    """A warm start far from the posterior (150 posterior sds) with a step too small to get there in 20 steps:
    every fold's own end-of-run report says it has not converged."""
    far = {"mu_auto_loc": np.float32(30.0), "mu_auto_scale": np.float32(0.2)}
    with pytest.warns(RuntimeWarning, match=r"5 of 5 K-fold fits reported a problem.*has not converged"):
        wf.kfold(normal_mean, AutoNormal(normal_mean), observations, k=4, folds=np.arange(24) % 4, result=far,
                 warm_steps=20, optim=nb.BLR(lr=0.01), num_draws=50)


def test_warm_start_auto_and_warm_steps():
    assert wf._resolve_warm_start("auto", {"a": 1})  # the full-data fit given: warm on any backend
    assert wf._resolve_warm_start("auto", None) == (jax.default_backend() == "cpu")
    assert wf._resolve_warm_start(False, None) is False and wf._resolve_warm_start(True, None) is True
    assert wf._warm_steps(None, 1000) == 100 and wf._warm_steps(None, 3000) == 300 and wf._warm_steps(None, 50) == 50


@pytest.mark.slow
def test_reloo_refits_equal_exact_leave_one_out(observations):
    y = observations[:10]
    res = wf.reloo(normal_mean, AutoNormal(normal_mean), y, k_threshold=-np.inf, num_steps=300, num_draws=2000)
    assert list(res.refitted) == list(range(10))
    exact, moments = np.empty(10), []
    for i in range(10):
        train = np.ones(10, bool)
        train[i] = False
        lp, m, v = exact_heldout(y, train)
        exact[i] = lp[i]
        moments.append((m, v))
    tol = mc_tolerance(y, moments, 2000)
    np.testing.assert_allclose(np.asarray(res.elpd_i), exact, atol=tol)
    assert abs(res.elpd - exact.sum()) < tol
    assert np.all(np.asarray(res.pareto_k) == 0.0)


@pytest.mark.slow
def test_sbc_calibrated_and_a_negative_control():
    y = np.zeros(8, np.float32)  # shapes only: SBC simulates its own data
    band = _ecdf_band(60, 49, level=0.999)
    good = wf.sbc(normal_mean, AutoNormal(normal_mean), y, num_datasets=60, num_draws=49, num_steps=200,
                  rng_key=jax.random.PRNGKey(5))
    assert good.ranks["mu"].shape == (60,) and good.ranks["mu"].min() >= 0 and good.ranks["mu"].max() <= 49
    assert good.max_deviation()["mu"] < band, good.summary()
    # without a curvature estimate the guide keeps AutoNormal's initial sd 0.1 against a posterior sd of 0.33:
    # the truth falls outside the draws, ranks pile up at 0 and 49
    with pytest.warns(RuntimeWarning, match="SBC fits reported a problem"):  # and the fits' reports say so
        bad = wf.sbc(normal_mean, AutoNormal(normal_mean), y, num_datasets=60, num_draws=49, num_steps=200,
                     optim=nb.BLR(hessian="none", lr=0.5), rng_key=jax.random.PRNGKey(5))
    assert len(bad.flagged) > 0
    assert bad.max_deviation()["mu"] > band, bad.summary()
    assert not bad.calibrated()["mu"]


@pytest.mark.slow
def test_sbc_plot(tmp_path):
    y = np.zeros(5, np.float32)
    res = wf.sbc(normal_mean, AutoNormal(normal_mean), y, num_datasets=12, num_draws=9, num_steps=50)
    path = tmp_path / "sbc.png"
    res.plot(path)
    assert path.stat().st_size > 1000
    assert "mu" in res.summary()


def two_outputs(x, y=None, z=None):
    a = numpyro.sample("a", dist.Normal(0.0, 1.0))
    with numpyro.plate("n", x.shape[0]):
        numpyro.sample("y", dist.Normal(a * x, 1.0), obs=y)
        numpyro.sample("z", dist.Normal(a, 1.0), obs=z)


def test_bad_input_names_the_argument(observations):
    y = observations[:6]
    guide = AutoNormal(normal_mean)
    with pytest.raises(WorkflowError, match=r"k must be between 2 and the number of observations of 'y' \(6\), got 7"):
        wf.kfold(normal_mean, guide, y, k=7)
    with pytest.raises(WorkflowError, match="k must be between 2"):
        wf.kfold(normal_mean, guide, y, k=1)
    with pytest.raises(WorkflowError, match="k must be an int"):
        wf.kfold(normal_mean, guide, y, k=2.5)
    with pytest.raises(WorkflowError, match=r"folds must be an int array of shape \(6,\)"):
        wf.kfold(normal_mean, guide, y, k=2, folds=np.zeros(5, int))
    with pytest.raises(WorkflowError, match="every fold"):
        wf.kfold(normal_mean, guide, y, k=3, folds=np.zeros(6, int))
    x = np.ones(6, np.float32)
    with pytest.raises(WorkflowError, match=r"several sites \['y', 'z'\]; pass obs="):
        wf.kfold(two_outputs, AutoNormal(two_outputs), x, y=y, z=y, k=2)
    with pytest.raises(WorkflowError, match="obs='w' is not an observed site"):
        wf.kfold(two_outputs, AutoNormal(two_outputs), x, y=y, z=y, k=2, obs="w")
    with pytest.raises(ValueError, match="of the model"):
        wf.kfold(normal_mean, AutoNormal(two_outputs), y, k=2)
    with pytest.raises(WorkflowError, match="num_datasets must be"):
        wf.sbc(normal_mean, guide, y, num_datasets=1)
    with pytest.raises(TypeError, match="optim must be"):
        wf.kfold(normal_mean, guide, y, k=2, optim=object())
    with pytest.raises(WorkflowError, match="warm_start must be one of"):
        wf.kfold(normal_mean, guide, y, k=2, warm_start="yes")
    with pytest.raises(WorkflowError, match="result= is the full-data fit the folds start from"):
        wf.kfold(normal_mean, guide, y, k=2, result={"mu_auto_loc": 0.0}, warm_start=False)
    with pytest.raises(WorkflowError, match="result must be the full-data fit"):
        wf.kfold(normal_mean, guide, y, k=2, result=object())
    with pytest.raises(ValueError, match=r"has the parameters \['b'\], but this guide's are \['mu_auto_loc', 'mu_auto_scale'\]"):
        wf.kfold(normal_mean, guide, y, k=2, result={"b": np.zeros(2)}, num_steps=5, num_draws=2)
    with pytest.raises(WorkflowError, match="warm_steps must be"):
        wf.kfold(normal_mean, guide, y, k=2, warm_start=True, warm_steps=0)


def regression(x, y):
    """Two latent sites (one a vector) and a 2-D observed site: draws and pointwise densities with several shapes."""
    b = numpyro.sample("b", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    s = numpyro.sample("s", dist.HalfNormal(1.0))
    with numpyro.plate("n", x.shape[0]):
        numpyro.sample("y", dist.Normal(b[0] + b[1] * x[:, None], s).to_event(1), obs=y)


@pytest.mark.parametrize("per_chunk", [None, 7])
def test_vectorised_draws_are_predictives_draws(monkeypatch, per_chunk):
    """The predictive densities and SBC's draws inside the programs are vectorised over the draws (in chunks when
    large): the same keys and values as NumPyro's Predictive and log_likelihood, which map them one at a time."""
    from jax.scipy.special import logsumexp
    from numpyro import handlers
    from numpyro.infer import Predictive
    from numpyro.infer.util import log_likelihood

    rng = np.random.default_rng(0)
    x = rng.normal(size=9)
    y = np.stack([1.0 + 2.0 * x, 1.0 - x], -1) + rng.normal(size=(9, 2))
    guide = AutoNormal(regression)
    params = nb.fit(regression, guide, x, y, num_steps=20, progress_bar=False).params
    key, S = jax.random.PRNGKey(3), 30
    if per_chunk:  # 30 draws in chunks of 7: four vectorised chunks and a padded fifth
        monkeypatch.setattr(wf, "DRAW_BATCH_ELEMENTS", per_chunk * y.size)
    got = wf._pointwise_lpd(params, key, (x, y), {}, regression, guide, "y", S, "unused", y.size)
    draws = Predictive(guide, params=params, num_samples=S)(key, x, y)
    ll = log_likelihood(handlers.substitute(regression, data=params), draws, x, y)["y"]  # (S, 9)
    # float32 here: vectorised and one-at-a-time arithmetic round differently, by a few units in the last place
    np.testing.assert_allclose(got, logsumexp(ll, axis=0) - np.log(S), rtol=1e-6)
    ranks = wf._ranks(params, key, (x, y), {}, guide, ("b", "s"), S, "unused", 3)
    ref = Predictive(guide, params=params, num_samples=S, return_sites=["b", "s"])(key, x, y)
    for site in ("b", "s"):
        assert ranks[site].shape == ref[site].shape == (S,) + ((2,) if site == "b" else ())
        np.testing.assert_allclose(ranks[site], ref[site], rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_reloo_on_centred_eight_schools_agrees_with_nuts():
    """The issue's target: exact refits where PSIS fails on the centred model, against az.loo on NUTS of the same
    posterior (non-centred: NUTS on the centred model diverges), within 2 standard errors."""
    import arviz as az

    sigma, y = rc.EIGHT_SIGMA, rc.EIGHT_Y
    centred, noncentred = rc.eight_schools_centered, rc.eight_schools_noncentered

    mcmc = MCMC(NUTS(noncentred, target_accept_prob=0.95), num_warmup=1000, num_samples=2000, num_chains=2,
                chain_method="sequential", progress_bar=False)
    mcmc.run(jax.random.PRNGKey(0), sigma, y=y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = az.loo(az.from_numpyro(mcmc, log_likelihood=True))
        res = wf.reloo(centred, AutoNormal(centred), sigma, y=y)
    assert len(res.refitted) >= 1
    assert abs(res.elpd - ref.elpd) < 2 * max(res.se, ref.se), (res.elpd, ref.elpd, res.se, ref.se)

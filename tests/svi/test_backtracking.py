"""Backtracking on the mean step (``nb.BLR(backtrack=True)``, the default).

Oracles: on a quadratic loss the full step always lowers the step's sample of the loss (so
backtracking must be an exact no-op there); the KL-optimal Gaussian is equivariant under an
affine change of the parameters, so a fit on raw, saturating predictors must equal the fit on
standardised ones mapped back.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.infer import SVI, Trace_ELBO
from numpyro.infer.autoguide import AutoMultivariateNormal, AutoNormal

import numpyro_blr as nb


def _fit(model, guide, opt, steps, *args, seed=0):
    svi = SVI(model, guide, opt, Trace_ELBO())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = svi.run(jax.random.PRNGKey(seed), steps, *args, progress_bar=False)
    return result, [str(w.message) for w in caught if "nb.BLR" in str(w.message)]


def _linear(X, y):
    w = numpyro.sample("w", dist.Normal(0.0, 3.0).expand([X.shape[1]]).to_event(1))
    numpyro.sample("y", dist.Normal(X @ w, 0.5), obs=y)


@pytest.mark.slow
def test_backtracking_is_a_no_op_on_a_quadratic_loss():
    """Linear-Gaussian model: phi(m + Delta) - phi(m) <= -rho/2 |g|^2_{S_new^-1} for every step,
    so no step is shortened and the run equals backtrack=False to rounding."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(50, 4)) * np.array([1.0, 10.0, 100.0, 0.1])
    y = X @ np.array([0.5, -0.1, 0.02, 3.0]) + 0.5 * rng.normal(size=50)
    with jax.enable_x64(True):
        args = (jnp.asarray(X), jnp.asarray(y))
        for guide_cls in (AutoMultivariateNormal, AutoNormal):
            on, _ = _fit(_linear, guide_cls(_linear), nb.BLR(), 60, *args)
            off, _ = _fit(_linear, guide_cls(_linear), nb.BLR(backtrack=False), 60, *args)
            assert int(on.state.optim_state[1].algorithm.trace.damped) == 0
            for k in on.params:
                np.testing.assert_allclose(on.params[k], off.params[k], rtol=1e-9, atol=1e-12)


def _logistic_mvn_prior(X, y, loc, cov):
    w = numpyro.sample("w", dist.MultivariateNormal(loc, covariance_matrix=cov))
    numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


@pytest.mark.slow
def test_saturating_raw_predictors_match_the_standardised_fit():
    """Logistic regression on predictors of size ~1e3 (an intercept column, then raw columns):
    from NumPyro's initialisation every logit saturates, the sampled Hessian is ~0 and an
    unshortened Newton mean step jumps by ~1e4 posterior sds back and forth. The same posterior
    written on standardised predictors, w_std = A w_raw, is well conditioned; the KL-optimal
    Gaussian commutes with the linear map, so both fits must agree."""
    rng = np.random.default_rng(3)
    n = 300
    raw = rng.normal(size=(n, 2)) * np.array([300.0, 50.0]) + np.array([1000.0, -400.0])
    X_raw = np.hstack([np.ones((n, 1)), raw])
    mu, sd = raw.mean(0), raw.std(0)
    X_std = np.hstack([np.ones((n, 1)), (raw - mu) / sd])
    # X_raw = X_std @ A with A mapping w_raw -> w_std (w_std = A w_raw)
    A = np.eye(3)
    A[0, 1:] = mu
    A[1:, 1:] = np.diag(sd)
    w_true = np.array([0.3, 1.0, -0.8])  # on the standardised scale
    y = (rng.uniform(size=n) < 1 / (1 + np.exp(-X_std @ w_true))).astype(float)
    prior_cov_raw = np.diag([25.0, 1.0, 1.0])
    with jax.enable_x64(True):
        raw_args = (jnp.asarray(X_raw), jnp.asarray(y), jnp.zeros(3), jnp.asarray(prior_cov_raw))
        std_args = (jnp.asarray(X_std), jnp.asarray(y), jnp.zeros(3), jnp.asarray(A @ prior_cov_raw @ A.T))
        guide_raw = AutoMultivariateNormal(_logistic_mvn_prior)
        res_raw, messages = _fit(_logistic_mvn_prior, guide_raw, nb.BLR(), 300, *raw_args)
        guide_std = AutoMultivariateNormal(_logistic_mvn_prior)
        res_std, _ = _fit(_logistic_mvn_prior, guide_std, nb.BLR(), 300, *std_args)
        post_raw = guide_raw.get_posterior(res_raw.params)
        post_std = guide_std.get_posterior(res_std.params)
        A_inv = np.linalg.inv(A)
        mean_ref = A_inv @ np.asarray(post_std.mean)
        cov_ref = A_inv @ np.asarray(post_std.covariance_matrix) @ A_inv.T
        sd_ref = np.sqrt(np.diag(cov_ref))
        mean = np.asarray(post_raw.mean)
        sd_fit = np.sqrt(np.diag(np.asarray(post_raw.covariance_matrix)))
    # both fits carry Monte Carlo noise of order sqrt(rho) ~ 0.05 sd at the end of the run
    assert np.max(np.abs(mean - mean_ref) / sd_ref) < 0.15
    np.testing.assert_allclose(sd_fit / sd_ref, 1.0, atol=0.15)
    report = nb.fit_report(res_raw)
    assert report.damped_steps > 0  # the mechanism was needed here...
    assert report.damped_recent < 0.05  # ...and not any more at the end
    assert messages == []


def _laplace_noise(y):
    x = numpyro.sample("x", dist.Normal(0.0, 100.0))
    numpyro.sample("y", dist.Laplace(x, 0.01), obs=y)


@pytest.mark.slow
def test_a_fit_that_backtracking_cannot_save_is_not_silent():
    """A Laplace likelihood is piecewise linear: its Hessian is 0 off the kinks, so the precision
    stays at the prior's 1e-4 while the gradient is +-100 per observation. Every full mean step
    jumps over the data and is shortened, but the guide's sd stays at the prior's 100, so the mean
    wanders: the run must end with a warning, and the report must show the shortened steps."""
    y = jnp.array([0.3, 0.31, 0.29, 0.305, 0.295])
    res, messages = _fit(_laplace_noise, AutoNormal(_laplace_noise), nb.BLR(), 200, y)
    report = nb.fit_report(res)
    assert report.damped_recent > 0.3 and report.damped_steps > 100
    assert report.problems and messages


@pytest.mark.slow
def test_report_names_steps_still_shortened_at_the_end():
    """The report's own rule: more than DAMPED_FRACTION of the recent steps shortened, and no
    divergence, gives one problem naming backtracking and the fix."""
    y = jnp.array([0.3, 0.31, 0.29, 0.305, 0.295])
    res, _ = _fit(_laplace_noise, AutoNormal(_laplace_noise), nb.BLR(), 20, y)
    step, s = res.state.optim_state
    tr = s.algorithm.trace
    calm = tr._replace(loss_avg=tr.loss_best, loss_var=jnp.zeros(()))
    still = (step, s._replace(algorithm=s.algorithm._replace(trace=calm._replace(damped_recent=jnp.asarray(0.5)))))
    done = (step, s._replace(algorithm=s.algorithm._replace(trace=calm._replace(damped_recent=jnp.asarray(0.1)))))
    assert any("shortened by backtracking" in p for p in nb.fit_report(still).problems)
    assert not any("shortened by backtracking" in p for p in nb.fit_report(done).problems)


_THREADS_PROBE = """
import json, os
import numpyro_blr
from numpyro_blr.core import limit_lapack_threads
from threadpoolctl import ThreadpoolController
import scipy.linalg.cython_lapack
blas = [c for c in ThreadpoolController().lib_controllers if c.user_api == "blas" and "scipy.libs" in c.filepath]
print(json.dumps([c.num_threads for c in blas]))
"""


def _probe(env):
    import json
    import os
    import subprocess
    import sys

    full = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
    full.update(env)
    out = subprocess.run([sys.executable, "-c", _THREADS_PROBE], env=full, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _scipy_blas_threads():
    from threadpoolctl import ThreadpoolController
    import scipy.linalg.cython_lapack  # noqa: F401 - jaxlib's CPU LAPACK

    return [c.num_threads for c in ThreadpoolController().lib_controllers
            if c.user_api == "blas" and "scipy.libs" in c.filepath]


def test_lapack_that_jax_calls_runs_single_threaded():
    """Every backtracking try of gp_pois_regr evaluates the model's Cholesky, a call into scipy's
    OpenBLAS (jaxlib's CPU LAPACK); with its default pool of one thread per core each such call on a
    small matrix is all thread hand-off (2.0 -> 0.13 ms per step on the 2-core machine under load,
    docs/robustness.md). Importing numpyro_blr sets that pool to one thread. Device-independent:
    the thread count, not a timing."""
    pytest.importorskip("threadpoolctl")
    counts = _scipy_blas_threads()
    if not counts:
        pytest.skip("no scipy-bundled OpenBLAS in this environment (a system LAPACK)")
    assert counts == [1] * len(counts), counts


@pytest.mark.slow
def test_lapack_threads_environment_variable_leaves_the_pool_alone():
    """NUMPYRO_BLR_LAPACK_THREADS=0: a process that wants scipy's threads keeps them (two fresh imports)."""
    pytest.importorskip("threadpoolctl")
    import os

    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: the default pool has one thread already")
    counts = _probe({})
    if not counts:
        pytest.skip("no scipy-bundled OpenBLAS in this environment (a system LAPACK)")
    assert counts == [1] * len(counts), counts
    assert max(_probe({"NUMPYRO_BLR_LAPACK_THREADS": "0"})) > 1


def test_lapack_threads_argument_is_checked():
    from numpyro_blr.core import limit_lapack_threads

    with pytest.raises(ValueError, match="threads must be an integer >= 0"):
        limit_lapack_threads(-1)
    with pytest.raises(ValueError, match="threads must be an integer >= 0"):
        limit_lapack_threads(1.5)
    assert limit_lapack_threads(0) == {}

"""Message passing against an independent implementation, BayesPy 0.6.6 (a test-only dependency), on identical
models, priors and initialisation: posterior moments to 1e-4 and the lower bound to 1e-4 relative (in practice
1e-12 or better, float64). Mixtures start from the same initial responsibilities and update their nodes in the
same order; stochastic VI sees the same minibatches with the same step sizes. Non-conjugate VMP on breast cancer
is compared with NUTS and with nb.BLR's Gaussian VI (AutoMultivariateNormal).

BayesPy's GaussianARD with ``shape=(D,)`` is a dense Gaussian over D (a NumPyro ``Normal(...).to_event(1)`` site
here), its ``Gamma`` of plates ``(K, D)`` a Gamma per entry, ``Mixture(Z, GaussianARD, mu, tau, 1)`` a diagonal
Gaussian likelihood per component.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from scipy.special import digamma

# a test-only dependency (pyproject's ``test`` extra, installed by ``make test``): imported, not skipped, so that a
# CI without it fails instead of silently dropping the comparison
from bayespy.inference import VB
from bayespy.nodes import Categorical, Dirichlet, Gamma, GaussianARD, Mixture, SumMultiply

from numpyro_blr.infer import ncvmp, svi, vmp

TOL = 1e-4


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # BayesPy's numpy deprecations
        yield


def rel(a, b):
    a, b = np.asarray(a, float), np.asarray(b, float)
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-8)))


@pytest.mark.slow
def test_bayesian_linear_regression_with_unknown_noise_precision(diabetes_np):
    X, y = diabetes_np
    X, y = X[:120, :5], y[:120]
    n, d = X.shape
    alpha0, a0, b0 = 0.5, 2.0, 1.5
    # BayesPy: w ~ N(0, alpha0^-1 I) (one dense Gaussian over D), tau ~ Gamma(a0, b0), y ~ N(X w, 1/tau)
    w = GaussianARD(0, alpha0, shape=(d,))
    tau = Gamma(a0, b0)
    f = SumMultiply("i,i", X, w)
    obs = GaussianARD(f, tau)
    obs.observe(y)
    q = VB(obs, w, tau)
    q.update(repeat=200, tol=1e-14, verbose=False)

    def model(X, y):
        w = numpyro.sample("w", dist.Normal(0.0, alpha0**-0.5).expand([d]).to_event(1))
        tau = numpyro.sample("tau", dist.Gamma(a0, b0))
        with numpyro.plate("n", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ w, 1.0 / jnp.sqrt(tau)), obs=y)

    algo = vmp(model, jnp.asarray(X), jnp.asarray(y))
    res = algo.run(algo.init(), num_steps=200, tol=1e-14, progress_bar=False)
    m, ww = w.get_moments()[:2]
    qw = res.posterior["w"]
    assert rel(qw.mean, m) < TOL
    assert rel(qw.covariance_matrix, ww - np.outer(m, m)) < TOL
    t, log_t = tau.get_moments()
    assert rel(res.posterior["tau"].mean, t) < TOL
    a, b = res.posterior["tau"].concentration, res.posterior["tau"].rate
    assert rel(digamma(float(a)) - np.log(float(b)), log_t) < TOL
    assert rel(res.elbo, q.compute_lowerbound()) < TOL


def mixture_data(n, k, d, seed):
    rng = np.random.default_rng(seed)
    centers = rng.normal(0, 4, (k, d))
    return centers[rng.integers(0, k, n)] + rng.normal(0, 1, (n, d))


def gmm(k, d):
    def model(y, batch=None):
        w = numpyro.sample("w", dist.Dirichlet(jnp.ones(k)))
        with numpyro.plate("k", k):
            mu = numpyro.sample("mu", dist.Normal(0.0, 10.0).expand([d]).to_event(1))
            tau = numpyro.sample("tau", dist.Gamma(1.0, 1.0).expand([d]).to_event(1))
        with numpyro.plate("n", y.shape[0], subsample_size=batch) as idx:
            z = numpyro.sample("z", dist.Categorical(w))
            numpyro.sample("y", dist.Normal(mu[z], 1.0 / jnp.sqrt(tau[z])).to_event(1), obs=y[idx])

    return model


def bayespy_gmm(n, k, d, plates_multiplier=None):
    alpha = Dirichlet(np.ones(k))
    kw = {} if plates_multiplier is None else {"plates_multiplier": (plates_multiplier,)}
    z = Categorical(alpha, plates=(n,), **kw)
    mu = GaussianARD(0, 1e-2, shape=(d,), plates=(k,))
    tau = Gamma(1.0, 1.0, plates=(k, d))
    obs = Mixture(z, GaussianARD, mu, tau, 1)
    return alpha, z, mu, tau, obs


def assert_globals_match(post, mu, tau, alpha, tol=TOL):
    assert rel(post["mu"].mean, mu.get_moments()[0]) < tol
    assert rel(post["tau"].mean, tau.get_moments()[0]) < tol
    conc = np.asarray(post["w"].concentration)
    assert rel(digamma(conc) - digamma(conc.sum()), alpha.get_moments()[0]) < tol


@pytest.mark.slow  # each compiles the mixture's sweep (about 7 s cold on 2 cores)
@pytest.mark.parametrize("n, k, d, sweeps", [(200, 3, 2, 40), (1000, 5, 2, 100)])
def test_gaussian_mixture_iteration_by_iteration(n, k, d, sweeps):
    y = mixture_data(n, k, d, seed=0)
    alpha, z, mu, tau, obs = bayespy_gmm(n, k, d)
    obs.observe(y)
    q = VB(obs, mu, tau, z, alpha)  # updates mu, tau, z, alpha in this order
    np.random.seed(1)
    z.initialize_from_random()
    r0 = z.get_moments()[0].copy()
    algo = vmp(gmm(k, d), jnp.asarray(y), order=("mu", "tau", "z", "w"))
    state = algo.init(init={"z": jnp.asarray(r0)})
    for _ in range(sweeps // 10):
        q.update(repeat=10, tol=0, verbose=False)
        for _ in range(10):
            state, info = algo.step(None, state)
        assert rel(info.elbo, q.compute_lowerbound()) < TOL
    assert_globals_match(algo.posterior(state), mu, tau, alpha)
    assert np.max(np.abs(np.asarray(algo.posterior(state)["z"].probs) - z.get_moments()[0])) < TOL


@pytest.mark.slow
@pytest.mark.parametrize("n, batch, steps", [(2000, 100, 30), (20000, 500, 120)])
def test_stochastic_vi_on_a_mixture(n, batch, steps):
    """Same minibatches, same step sizes rho_t = (t + 1)^-0.7 (BayesPy's gradient_step with delay 1, ours tau = 0):
    the global posteriors agree along the way, and so does the whole-data lower bound with the assignments at their
    optimum (BayesPy's full model given the SVI globals, one update of Z)."""
    k, d = 4, 2
    y = mixture_data(n, k, d, seed=2)
    rng = np.random.default_rng(3)
    batches = [rng.choice(n, batch, replace=False) for _ in range(steps)]
    m0 = y[rng.choice(n, k, replace=False)]
    alpha, z, mu, tau, obs = bayespy_gmm(batch, k, d, plates_multiplier=n / batch)
    mu.initialize_from_parameters(m0, np.ones((k, d)))
    q = VB(obs, z, mu, tau, alpha)
    q.ignore_bound_checks = True
    algo = svi(gmm(k, d), jnp.asarray(y), batch, kappa=0.7, tau=0.0)
    state = algo.init(init={"mu": dist.Normal(jnp.asarray(m0), 1.0).to_event(1)})
    for t, idx in enumerate(batches):
        obs.observe(y[idx])
        q.update(z, verbose=False)
        q.gradient_step(mu, tau, alpha, scale=(t + 1.0) ** -0.7)
        state, _ = algo.step(None, state, indices=idx)
    assert_globals_match(algo.posterior(state), mu, tau, alpha)
    # whole-data lower bound at the SVI globals
    alpha_f, z_f, mu_f, tau_f, obs_f = bayespy_gmm(n, k, d)
    obs_f.observe(y)
    q_f = VB(obs_f, z_f, mu_f, tau_f, alpha_f)
    for full, mini in ((mu_f, mu), (tau_f, tau), (alpha_f, alpha)):
        full.set_parameters(mini.get_parameters())
    q_f.update(z_f, verbose=False)
    elbo, _ = algo.elbo(state)
    assert rel(elbo, q_f.compute_lowerbound()) < TOL


@pytest.mark.slow
def test_nonconjugate_vmp_breast_cancer_against_nuts_and_blr(breast_cancer, breast_cancer_nuts):
    """Logistic regression (31 coefficients): non-conjugate VMP's means are within 0.1 NUTS-sd, and its ELBO (Monte
    Carlo, 20,000 draws, common to both) is at least nb.BLR's with AutoMultivariateNormal minus 0.5 nat."""
    import numpyro_blr as nb
    from numpyro.infer import SVI, Trace_ELBO
    from numpyro.infer.autoguide import AutoMultivariateNormal
    from numpyro.infer.util import log_density

    from conftest import logistic_model

    X, y = (jnp.asarray(a, jnp.float64) for a in breast_cancer)
    draws = np.asarray(breast_cancer_nuts.get_samples()["w"], np.float64)
    mean, sd = draws.mean(0), draws.std(0)
    algo = ncvmp(logistic_model, X, y)
    res = algo.run(algo.init(), num_steps=200, tol=1e-9, progress_bar=False)
    assert res.converged
    q = res.posterior["w"]
    assert np.max(np.abs(np.asarray(q.mean) - mean) / sd) < 0.1

    def elbo_mc(dist_):
        w = dist_.sample(jax.random.PRNGKey(7), (20000,))
        lp = jax.vmap(lambda wi: log_density(logistic_model, (X, y), {}, {"w": wi})[0])(w)
        return float(jnp.mean(lp - dist_.log_prob(w)))

    guide = AutoMultivariateNormal(logistic_model)
    fit = SVI(logistic_model, guide, nb.BLR(), Trace_ELBO()).run(jax.random.PRNGKey(0), 1000, X, y, progress_bar=False)
    assert elbo_mc(q) >= elbo_mc(guide.get_posterior(fit.params)) - 0.5

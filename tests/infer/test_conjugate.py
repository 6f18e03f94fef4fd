"""Exact conjugate updates and VMP (``numpyro_blr.infer.conjugate_fit``) against closed forms.

Every closed form below is written out here, independently of the package: conjugate posteriors
from the textbook update formulas and log evidences as marginal likelihoods (Beta/Gamma/Dirichlet
normalisers, or the Gaussian marginal ``y ~ N(X m0, sigma^2 I + X S0 X^T)``). One BLR step with
rho = 1 must reproduce both to 1e-6 relative in float64.

The mean-field Normal x Gamma model is compared with coordinate ascent (CAVI) written here from
the VB fixed-point equations (Bishop 2006, Sec. 10.1.3), and a real-data Gamma-Poisson fit
(Linnerud "Chins" counts, shipped with scikit-learn) with NUTS.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from scipy import special, stats

from numpyro_blr.infer import NonConjugateError, conjugate_fit

RTOL = 1e-6


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def rel(a, b):
    a, b = np.asarray(a, float), np.asarray(b, float)
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-12)))


def log_beta_fn(alpha):
    alpha = np.asarray(alpha, float)
    return float(np.sum(special.gammaln(alpha)) - special.gammaln(np.sum(alpha)))


# ---------------------------------------------------------------------------------------------
# one-step conjugate cases
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_beta_bernoulli():
    a, b = 2.0, 3.0
    y = np.array([1, 0, 1, 1, 1, 0, 1, 1, 0, 1], float)

    def model(y):
        p = numpyro.sample("p", dist.Beta(a, b))
        with numpyro.plate("n", len(y)):
            numpyro.sample("y", dist.Bernoulli(probs=p), obs=y)

    res = conjugate_fit(model, jnp.asarray(y))
    s, n = y.sum(), len(y)
    q = res.posterior["p"]
    assert rel(q.concentration1, a + s) < RTOL and rel(q.concentration0, b + n - s) < RTOL
    log_evidence = log_beta_fn([a + s, b + n - s]) - log_beta_fn([a, b])
    assert rel(res.elbo, log_evidence) < RTOL
    assert res.factors == {"p": ("p",), "y": ("p",)}


@pytest.mark.slow
def test_beta_binomial():
    a, b = 0.7, 1.8
    trials = np.array([5, 8, 3, 10])
    y = np.array([2, 5, 0, 7])

    def model(trials, y):
        p = numpyro.sample("p", dist.Beta(a, b))
        numpyro.sample("y", dist.Binomial(total_count=trials, probs=p), obs=y)

    res = conjugate_fit(model, jnp.asarray(trials), jnp.asarray(y))
    q = res.posterior["p"]
    assert rel(q.concentration1, a + y.sum()) < RTOL and rel(q.concentration0, b + (trials - y).sum()) < RTOL
    log_choose = np.sum(special.gammaln(trials + 1) - special.gammaln(y + 1) - special.gammaln(trials - y + 1))
    log_evidence = log_choose + log_beta_fn([a + y.sum(), b + (trials - y).sum()]) - log_beta_fn([a, b])
    assert rel(res.elbo, log_evidence) < RTOL


def test_gamma_poisson():
    a, b = 2.5, 0.5
    y = np.array([3, 7, 4, 0, 5, 6, 2], float)

    def model(y):
        lam = numpyro.sample("lam", dist.Gamma(a, b))
        numpyro.sample("y", dist.Poisson(lam), obs=y)

    res = conjugate_fit(model, jnp.asarray(y))
    q = res.posterior["lam"]
    a_post, b_post = a + y.sum(), b + len(y)
    assert rel(q.concentration, a_post) < RTOL and rel(q.rate, b_post) < RTOL
    log_evidence = (a * math.log(b) - special.gammaln(a) + special.gammaln(a_post) - a_post * math.log(b_post)
                    - np.sum(special.gammaln(y + 1)))
    assert rel(res.elbo, log_evidence) < RTOL
    nat = res.natural_params["lam"]
    assert rel(nat.eta1, a_post - 1) < RTOL and rel(nat.eta2, -b_post) < RTOL


def test_gamma_exponential():
    a, b = 3.0, 2.0
    x = np.array([0.3, 1.2, 0.05, 2.2, 0.8])

    def model(x):
        rate = numpyro.sample("rate", dist.Gamma(a, b))
        numpyro.sample("x", dist.Exponential(rate), obs=x)

    res = conjugate_fit(model, jnp.asarray(x))
    q = res.posterior["rate"]
    a_post, b_post = a + len(x), b + x.sum()
    assert rel(q.concentration, a_post) < RTOL and rel(q.rate, b_post) < RTOL
    log_evidence = a * math.log(b) - special.gammaln(a) + special.gammaln(a_post) - a_post * math.log(b_post)
    assert rel(res.elbo, log_evidence) < RTOL


@pytest.mark.slow
def test_normal_normal_known_variance():
    m0, s0, sigma = 1.0, 2.0, 0.7
    y = np.array([0.3, 1.9, 1.1, 0.4, 2.5, 1.7])

    def model(y):
        mu = numpyro.sample("mu", dist.Normal(m0, s0))
        with numpyro.plate("n", len(y)):
            numpyro.sample("y", dist.Normal(mu, sigma), obs=y)

    res = conjugate_fit(model, jnp.asarray(y))
    prec = 1 / s0**2 + len(y) / sigma**2
    mean = (m0 / s0**2 + y.sum() / sigma**2) / prec
    q = res.posterior["mu"]
    assert rel(q.loc, mean) < RTOL and rel(q.scale, prec**-0.5) < RTOL
    cov = sigma**2 * np.eye(len(y)) + s0**2 * np.ones((len(y), len(y)))
    log_evidence = stats.multivariate_normal(np.full(len(y), m0), cov).logpdf(y)
    assert rel(res.elbo, log_evidence) < RTOL


@pytest.mark.slow
def test_bayesian_linear_regression(diabetes_np):
    X, y = diabetes_np
    X, y = X[:150, :4], y[:150]
    s0, sigma = 1.5, 0.8
    d = X.shape[1]

    def model(X, y):
        w = numpyro.sample("w", dist.Normal(0.0, s0).expand([d]).to_event(1))
        numpyro.sample("y", dist.Normal(X @ w, sigma).to_event(1), obs=y)

    res = conjugate_fit(model, jnp.asarray(X), jnp.asarray(y))
    prec = X.T @ X / sigma**2 + np.eye(d) / s0**2
    mean = np.linalg.solve(prec, X.T @ y / sigma**2)
    q = res.posterior["w"]
    assert rel(q.loc, mean) < RTOL
    assert rel(q.precision_matrix, prec) < RTOL
    cov = sigma**2 * np.eye(len(y)) + s0**2 * X @ X.T
    log_evidence = stats.multivariate_normal(np.zeros(len(y)), cov).logpdf(y)
    assert rel(res.elbo, log_evidence) < RTOL


@pytest.mark.slow
def test_dirichlet_categorical():
    alpha = np.array([0.5, 1.0, 2.0, 1.5])
    y = np.array([0, 2, 2, 1, 3, 2, 0, 2])

    def model(y):
        theta = numpyro.sample("theta", dist.Dirichlet(jnp.asarray(alpha)))
        with numpyro.plate("n", len(y)):
            numpyro.sample("y", dist.Categorical(probs=theta), obs=y)

    res = conjugate_fit(model, jnp.asarray(y))
    counts = np.bincount(y, minlength=len(alpha))
    assert rel(res.posterior["theta"].concentration, alpha + counts) < RTOL
    log_evidence = log_beta_fn(alpha + counts) - log_beta_fn(alpha)
    assert rel(res.elbo, log_evidence) < RTOL


@pytest.mark.slow
def test_dirichlet_multinomial():
    alpha = np.array([1.0, 2.0, 0.5])
    y = np.array([[3, 1, 0], [2, 2, 1], [0, 4, 1]])

    def model(y):
        theta = numpyro.sample("theta", dist.Dirichlet(jnp.asarray(alpha)))
        with numpyro.plate("n", y.shape[0]):
            numpyro.sample("y", dist.Multinomial(total_count=y.sum(-1), probs=theta), obs=y)

    res = conjugate_fit(model, jnp.asarray(y))
    counts = y.sum(0)
    assert rel(res.posterior["theta"].concentration, alpha + counts) < RTOL
    log_coef = np.sum(special.gammaln(y.sum(-1) + 1)) - np.sum(special.gammaln(y + 1))
    log_evidence = log_coef + log_beta_fn(alpha + counts) - log_beta_fn(alpha)
    assert rel(res.elbo, log_evidence) < RTOL


def test_discrete_latent_bernoulli():
    """A binary latent: its complete conditional is always Bernoulli; posterior logit and evidence exact."""
    prior, y = 0.3, np.array([0.4, -0.2, 1.1])

    def model(y):
        z = numpyro.sample("z", dist.Bernoulli(prior))
        with numpyro.plate("n", len(y)):
            numpyro.sample("y", dist.Normal(jnp.where(z == 1, 1.0, -1.0), 1.0), obs=y)

    res = conjugate_fit(model, jnp.asarray(y))
    log1 = math.log(prior) + stats.norm(1.0).logpdf(y).sum()
    log0 = math.log(1 - prior) + stats.norm(-1.0).logpdf(y).sum()
    assert rel(res.posterior["z"].logits, log1 - log0) < RTOL
    assert rel(res.elbo, np.logaddexp(log0, log1)) < RTOL


# ---------------------------------------------------------------------------------------------
# VMP: mean-field Normal x Gamma
# ---------------------------------------------------------------------------------------------


def cavi_normal_gamma(y, m0, k0, a0, b0, iters=500):
    """Coordinate ascent for q(mu) q(tau), prior mu ~ N(m0, 1/k0), tau ~ Gamma(a0, b0), y ~ N(mu, 1/tau).

    Fixed point (Bishop 2006, Sec. 10.1.3 with an independent prior on mu):
    q(mu) = N(m, 1/p), p = k0 + n E[tau], m = (k0 m0 + E[tau] sum y) / p;
    q(tau) = Gamma(a0 + n/2, b0 + (sum (y - m)^2 + n / p) / 2).
    """
    n = len(y)
    e_tau = a0 / b0
    for _ in range(iters):
        p = k0 + n * e_tau
        m = (k0 * m0 + e_tau * y.sum()) / p
        a = a0 + n / 2
        b = b0 + 0.5 * (np.sum((y - m) ** 2) + n / p)
        e_tau = a / b
    return m, p, a, b


@pytest.mark.slow
def test_normal_gamma_vmp_matches_cavi():
    m0, k0, a0, b0 = 0.5, 0.1, 2.0, 1.0
    y = np.random.default_rng(3).normal(1.0, 2.0, size=40)

    def model(y):
        mu = numpyro.sample("mu", dist.Normal(m0, k0**-0.5))
        tau = numpyro.sample("tau", dist.Gamma(a0, b0))
        with numpyro.plate("n", len(y)):
            numpyro.sample("y", dist.Normal(mu, 1.0 / jnp.sqrt(tau)), obs=y)

    res = conjugate_fit(model, jnp.asarray(y), num_steps=40)
    m, p, a, b = cavi_normal_gamma(y, m0, k0, a0, b0)
    assert rel(res.posterior["mu"].loc, m) < 1e-8
    assert rel(res.posterior["mu"].scale, p**-0.5) < 1e-8
    assert rel(res.posterior["tau"].concentration, a) < 1e-8
    assert rel(res.posterior["tau"].rate, b) < 1e-8
    # coordinate ascent on the exact ELBO never decreases it
    assert np.all(np.diff(res.elbo_history) > -1e-9)
    # resuming from the fixed point stays there
    again = conjugate_fit(model, jnp.asarray(y), init=res.posterior)
    assert rel(again.posterior["mu"].loc, m) < 1e-8 and rel(again.posterior["tau"].rate, b) < 1e-8
    # the ELBO at the fixed point, written out independently
    e_tau, e_log_tau = a / b, special.digamma(a) - math.log(b)
    n = len(y)
    e_loglik = 0.5 * n * (e_log_tau - math.log(2 * math.pi)) - 0.5 * e_tau * (np.sum((y - m) ** 2) + n / p)
    e_logprior_mu = 0.5 * math.log(k0 / (2 * math.pi)) - 0.5 * k0 * ((m - m0) ** 2 + 1 / p)
    e_logprior_tau = a0 * math.log(b0) - special.gammaln(a0) + (a0 - 1) * e_log_tau - b0 * e_tau
    h_mu = 0.5 * math.log(2 * math.pi * math.e / p)
    h_tau = a - math.log(b) + special.gammaln(a) + (1 - a) * special.digamma(a)
    assert rel(res.elbo, e_loglik + e_logprior_mu + e_logprior_tau + h_mu + h_tau) < 1e-8


# ---------------------------------------------------------------------------------------------
# BLR with rho < 1, errors, real data against NUTS
# ---------------------------------------------------------------------------------------------


def test_damped_steps_converge_geometrically_and_stay_valid():
    """rho < 1: lam_t = (1-rho)^t lam_0 + (1 - (1-rho)^t) lam_post, a convex combination (always valid)."""
    y = np.array([1.0, 4.0, 2.0])

    def model(y):
        lam = numpyro.sample("lam", dist.Gamma(1.0, 1.0))
        numpyro.sample("y", dist.Poisson(lam), obs=y)

    res = conjugate_fit(model, jnp.asarray(y), num_steps=3, lr=0.5)
    w = 0.5**3
    a = w * 1.0 + (1 - w) * (1.0 + y.sum())
    b = w * 1.0 + (1 - w) * (1.0 + len(y))
    assert rel(res.posterior["lam"].concentration, a) < RTOL and rel(res.posterior["lam"].rate, b) < RTOL


def test_nonconjugate_site_is_named():
    def model(y):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        numpyro.sample("y", dist.Poisson(jnp.exp(mu)), obs=y)

    with pytest.raises(NonConjugateError, match=r"site 'mu' \(Gaussian family, support real"):
        conjugate_fit(model, jnp.array([1.0, 2.0, 3.0]))


def test_unsupported_prior_is_named():
    def model(y):
        s = numpyro.sample("s", dist.LogNormal(0.0, 1.0))
        numpyro.sample("y", dist.Normal(0.0, s), obs=y)

    with pytest.raises(NonConjugateError, match=r"site 's': prior LogNormal"):
        conjugate_fit(model, jnp.array([1.0, 2.0]))


@pytest.mark.slow
def test_gamma_poisson_real_data_against_nuts():
    from numpyro.infer import MCMC, NUTS
    from sklearn.datasets import load_linnerud

    chins = jnp.asarray(load_linnerud().data[:, 0])  # 20 counts

    def model(y):
        lam = numpyro.sample("lam", dist.Gamma(1.0, 0.1))
        with numpyro.plate("n", y.shape[0]):
            numpyro.sample("y", dist.Poisson(lam), obs=y)

    res = conjugate_fit(model, chins)
    mcmc = MCMC(NUTS(model), num_warmup=300, num_samples=2000, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(1), chins)
    draws = np.asarray(mcmc.get_samples()["lam"])
    q = res.posterior["lam"]
    assert abs(float(q.mean) - draws.mean()) < 0.1 * draws.std()
    assert abs(float(jnp.sqrt(q.variance)) / draws.std() - 1) < 0.1

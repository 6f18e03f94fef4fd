"""Exact conjugate updates and VMP from the model's log density (``numpyro_blr.infer.conjugate_fit``).

For each model below, one BLR step with rho = 1 and exact expectations (Khan & Rue 2023, Sec. 5)
is compared with the textbook closed-form posterior, and the exact ELBO with the closed-form log
evidence. The conjugacy is *detected* from the model's log density (no table of conjugate pairs).
The last model (unknown mean and precision, mean-field Normal x Gamma) needs several steps:
variational message passing (Winn & Bishop 2005); the ELBO climbs to its fixed point.
A non-conjugate model is rejected with an error naming the site.

Run: python examples/conjugate_models.py
"""

import math

import jax

jax.config.update("jax_enable_x64", True)  # closed forms to ~1e-12

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import numpyro  # noqa: E402
import numpyro.distributions as dist  # noqa: E402
from scipy import special, stats  # noqa: E402
from sklearn.datasets import load_diabetes, load_linnerud  # noqa: E402

from numpyro_blr.infer import NonConjugateError, conjugate_fit  # noqa: E402


def row(name, fitted, exact):
    fitted, exact = np.ravel(np.asarray(fitted, float)), np.ravel(np.asarray(exact, float))
    err = np.max(np.abs(fitted - exact)) / np.max(np.abs(exact))  # relative to the largest entry
    shown = ", ".join(f"{v:.6g}" for v in fitted[:4]) + (", ..." if fitted.size > 4 else "")
    print(f"  {name:<22} {shown:<48} rel. err {err:.1e}")


def gamma_poisson():
    chins = load_linnerud().data[:, 0]  # 20 counts (scikit-learn's Linnerud data)
    a, b = 1.0, 0.1

    def model(y):
        lam = numpyro.sample("lam", dist.Gamma(a, b))
        with numpyro.plate("n", y.shape[0]):
            numpyro.sample("y", dist.Poisson(lam), obs=y)

    res = conjugate_fit(model, jnp.asarray(chins))
    a_post, b_post = a + chins.sum(), b + len(chins)
    log_z = (a * math.log(b) - special.gammaln(a) + special.gammaln(a_post) - a_post * math.log(b_post)
             - np.sum(special.gammaln(chins + 1)))
    print("Gamma-Poisson (Linnerud chin-ups, 20 counts)")
    row("shape a", res.posterior["lam"].concentration, a_post)
    row("rate b", res.posterior["lam"].rate, b_post)
    row("ELBO vs log evidence", res.elbo, log_z)


def beta_binomial():
    trials, y = np.array([5, 8, 3, 10]), np.array([2, 5, 0, 7])

    def model(trials, y):
        p = numpyro.sample("p", dist.Beta(1.0, 1.0))
        numpyro.sample("y", dist.Binomial(total_count=trials, probs=p), obs=y)

    res = conjugate_fit(model, jnp.asarray(trials), jnp.asarray(y))
    a_post, b_post = 1 + y.sum(), 1 + (trials - y).sum()
    log_choose = np.sum(special.gammaln(trials + 1) - special.gammaln(y + 1) - special.gammaln(trials - y + 1))
    log_z = log_choose + special.betaln(a_post, b_post) - special.betaln(1, 1)
    print("Beta-Binomial")
    row("a, b", [res.posterior["p"].concentration1, res.posterior["p"].concentration0], [a_post, b_post])
    row("ELBO vs log evidence", res.elbo, log_z)


def dirichlet_categorical():
    alpha = np.array([0.5, 1.0, 2.0])
    y = np.array([0, 2, 2, 1, 2, 0, 2])

    def model(y):
        theta = numpyro.sample("theta", dist.Dirichlet(jnp.asarray(alpha)))
        with numpyro.plate("n", len(y)):
            numpyro.sample("y", dist.Categorical(probs=theta), obs=y)

    res = conjugate_fit(model, jnp.asarray(y))
    post = alpha + np.bincount(y, minlength=3)

    def log_b(x):
        return np.sum(special.gammaln(x)) - special.gammaln(np.sum(x))

    print("Dirichlet-Categorical")
    row("concentration", res.posterior["theta"].concentration, post)
    row("ELBO vs log evidence", res.elbo, log_b(post) - log_b(alpha))


def linear_regression():
    X, y = load_diabetes(return_X_y=True)
    X = (X - X.mean(0)) / X.std(0)
    X = np.hstack([np.ones((len(X), 1)), X[:, :4]])
    y = (y - y.mean()) / y.std()
    s0, sigma = 1.0, 0.8

    def model(X, y):
        w = numpyro.sample("w", dist.Normal(0.0, s0).expand([X.shape[1]]).to_event(1))
        numpyro.sample("y", dist.Normal(X @ w, sigma).to_event(1), obs=y)

    res = conjugate_fit(model, jnp.asarray(X), jnp.asarray(y))
    prec = X.T @ X / sigma**2 + np.eye(X.shape[1]) / s0**2
    mean = np.linalg.solve(prec, X.T @ y / sigma**2)
    log_z = stats.multivariate_normal(np.zeros(len(y)), sigma**2 * np.eye(len(y)) + s0**2 * X @ X.T).logpdf(y)
    print("Bayesian linear regression (diabetes, intercept + 4 features, known noise)")
    row("posterior mean", res.posterior["w"].loc, mean)
    row("posterior precision", res.posterior["w"].precision_matrix, prec)
    row("ELBO vs log evidence", res.elbo, log_z)


def normal_gamma_vmp():
    y = np.random.default_rng(0).normal(1.0, 2.0, size=50)

    def model(y):
        mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
        tau = numpyro.sample("tau", dist.Gamma(1.0, 1.0))
        with numpyro.plate("n", len(y)):
            numpyro.sample("y", dist.Normal(mu, 1.0 / jnp.sqrt(tau)), obs=y)

    res = conjugate_fit(model, jnp.asarray(y), num_steps=15)
    print("Unknown mean and precision, mean-field Normal x Gamma (VMP, 15 sweeps)")
    print("  ELBO per sweep:", ", ".join(f"{e:.6f}" for e in res.elbo_history[:6]), "...", f"{res.elbo_history[-1]:.6f}")
    print(f"  q(mu) = N({float(res.posterior['mu'].loc):.4f}, {float(res.posterior['mu'].scale):.4f}^2)   "
          f"sample mean {y.mean():.4f}")
    tau = res.posterior["tau"]
    print(f"  q(tau) = Gamma({float(tau.concentration):.2f}, {float(tau.rate):.2f}), E[tau] = {float(tau.mean):.4f}   "
          f"1/sample var {1 / y.var():.4f}")


def non_conjugate():
    def model(y):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        numpyro.sample("y", dist.Poisson(jnp.exp(mu)), obs=y)

    print("Non-conjugate (Poisson with log link):")
    try:
        conjugate_fit(model, jnp.array([1.0, 2.0, 3.0]))
    except NonConjugateError as err:
        print("  NonConjugateError:", str(err)[:160], "...")


if __name__ == "__main__":
    gamma_poisson()
    beta_binomial()
    dirichlet_categorical()
    linear_regression()
    normal_gamma_vmp()
    non_conjugate()

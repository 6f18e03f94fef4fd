"""Non-conjugate VMP on breast-cancer logistic regression (scikit-learn), against NUTS.

The logistic likelihood is not conjugate to the Gaussian prior, so exact VMP (``numpyro_blr.infer.vmp``) refuses
the model, naming the site and the factor. ``numpyro_blr.infer.ncvmp`` finds that the likelihood reads the
coefficients through its logits, an affine function of them: under q the logit of each tumour is Gaussian, and
the expected log likelihood is a one-dimensional Gauss-Hermite integral per tumour (Knowles & Minka 2011). The
Gaussian's BLR step (rules.blr.gaussian_update) then uses E_q[gradient] and E_q[Hessian] of that expectation; a
fit converges to a tolerance. Prints the sweeps, the time and the ELBO, and the posterior means and standard
deviations against NUTS's; writes figures/nonconjugate_vmp.png (ELBO per sweep; means and sds against NUTS).

Run: python examples/nonconjugate_vmp.py
"""

import pathlib
import time

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import numpyro  # noqa: E402
import numpyro.distributions as dist  # noqa: E402
from numpyro.infer import MCMC, NUTS  # noqa: E402
from sklearn.datasets import load_breast_cancer  # noqa: E402

from numpyro_blr.infer import NonConjugateError, ncvmp, vmp  # noqa: E402

FIGURE = pathlib.Path(__file__).resolve().parents[1] / "figures" / "nonconjugate_vmp.png"


def model(X, y):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def main():
    X, y = load_breast_cancer(return_X_y=True)
    X = (X - X.mean(0)) / X.std(0)
    X, y = jnp.asarray(np.hstack([np.ones((len(X), 1)), X])), jnp.asarray(y, float)

    try:
        vmp(model, X, y)
    except NonConjugateError as err:
        print("exact VMP:", str(err).split(". Exact VMP")[0] + ".")

    t = time.perf_counter()
    algo = ncvmp(model, X, y)
    res = algo.run(algo.init(), num_steps=500, tol=1e-9, progress_bar=False)
    t_nc = time.perf_counter() - t
    print(f"non-conjugate VMP: {res.num_steps} sweeps, {t_nc:.1f} s (with compilation), ELBO {res.elbo:.3f}; "
          f"factor 'y' integrated along {algo.engine.projected['y'][1][1]} link of its logits")
    print(res.report)

    t = time.perf_counter()
    mcmc = MCMC(NUTS(model), num_warmup=500, num_samples=1500, num_chains=2, chain_method="sequential", progress_bar=False)
    mcmc.run(jax.random.PRNGKey(2), X, y)
    t_nuts = time.perf_counter() - t
    draws = np.asarray(mcmc.get_samples()["w"])
    mean, sd = draws.mean(0), draws.std(0)
    q = res.posterior["w"]
    q_mean, q_sd = np.asarray(q.mean), np.sqrt(np.diag(np.asarray(q.covariance_matrix)))
    err = np.abs(q_mean - mean) / sd
    print(f"NUTS: 2 x 1,500 draws, {t_nuts:.1f} s")
    print(f"means: largest |VMP - NUTS| / NUTS sd = {err.max():.3f} (median {np.median(err):.3f}); "
          f"sd ratios VMP / NUTS {np.min(q_sd / sd):.2f}-{np.max(q_sd / sd):.2f}")

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    axes[0].plot(np.arange(1, len(res.elbo_history) + 1), res.elbo_history, "o-", ms=3)
    axes[0].set_xlabel("sweep")
    axes[0].set_ylabel("ELBO")
    axes[0].set_title("non-conjugate VMP")
    lim = [min(mean.min(), q_mean.min()) - 0.2, max(mean.max(), q_mean.max()) + 0.2]
    axes[1].errorbar(mean, q_mean, xerr=sd, fmt="o", ms=3, lw=0.6)
    axes[1].plot(lim, lim, "k--", lw=0.8)
    axes[1].set_xlabel("NUTS posterior mean (+- sd)")
    axes[1].set_ylabel("VMP posterior mean")
    axes[1].set_title("31 coefficients")
    axes[2].plot(sd, q_sd, "o", ms=3)
    lim = [0, max(sd.max(), q_sd.max()) * 1.05]
    axes[2].plot(lim, lim, "k--", lw=0.8)
    axes[2].set_xlabel("NUTS posterior sd")
    axes[2].set_ylabel("VMP posterior sd")
    axes[2].set_title("a Gaussian fits the posterior closely")
    FIGURE.parent.mkdir(exist_ok=True)
    fig.tight_layout()
    fig.savefig(FIGURE, dpi=120)
    print(f"figure: {FIGURE}")


if __name__ == "__main__":
    main()

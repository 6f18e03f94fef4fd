"""Online Bayes: last month's posterior is this month's prior (nb.online.Stream).

1. Exact: Bayesian linear regression with known noise on scikit-learn's diabetes data (442 x 10, standardised,
   plus intercept), fed in 10 batches by exact conjugate updates (rho = 1): the last posterior equals the
   closed-form posterior of all the data (the max. difference is printed).
2. Approximate: the same regression with unknown noise (sigma ~ HalfNormal(1)), AutoMultivariateNormal fitted by
   nb.BLR() batch after batch (4 batches of ~110 rows, "quarters"). Prints each batch's report (ELBO, the
   measured Gaussian projection error, k-hat), the wall time of each update (the first two compile; later
   batches of the same size reuse the program), and the final posterior against one fit on all the data and a
   NUTS run on all the data, in NUTS posterior sds.

Run: python examples/online_regression.py [--quick]
"""

import argparse
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.infer import MCMC, NUTS
from numpyro.infer.autoguide import AutoMultivariateNormal
from sklearn.datasets import load_diabetes

import numpyro_blr as nb
from numpyro_blr import online


def known_noise(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    numpyro.sample("y", dist.Normal(X @ w, 0.7), obs=y)


def regression(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    numpyro.sample("y", dist.Normal(X @ w, sigma), obs=y)


def data():
    X, y = load_diabetes(return_X_y=True)
    X = (X - X.mean(0)) / X.std(0)
    return np.hstack([np.ones((X.shape[0], 1)), X]), (y - y.mean()) / y.std()


def exact_part(X, y):
    precision = np.eye(X.shape[1]) + X.T @ X / 0.7**2
    mean = np.linalg.solve(precision, X.T @ y / 0.7**2)
    stream = online.Stream(known_noise, "conjugate", num_steps=1)
    for xb, yb in zip(np.array_split(X, 10), np.array_split(y, 10)):
        stream.update(jnp.asarray(xb), jnp.asarray(yb))
    post = stream.prior.distributions["w"]
    print("1. Known noise, 10 batches of exact conjugate updates (rho = 1):")
    print(f"   max |mean - closed form| = {np.max(np.abs(np.asarray(post.loc) - mean)):.1e}, "
          f"max |cov - closed form| = {np.max(np.abs(np.asarray(post.covariance_matrix) - np.linalg.inv(precision))):.1e}")


def moments(prior):
    """(mean, sd) of w and the median of sigma, from a Prior over (w, log sigma)."""
    cov = np.asarray(prior.scale_tril @ prior.scale_tril.T)
    loc, sd = np.asarray(prior.loc), np.sqrt(np.diag(cov))
    blocks = prior.site_slices()
    return loc[blocks["w"]], sd[blocks["w"]], float(np.exp(loc[blocks["sigma"]][0]))


def approximate_part(X, y, num_steps, num_samples):
    print("\n2. Unknown noise, AutoMultivariateNormal + nb.BLR(), 4 batches:")
    stream = online.Stream(regression, AutoMultivariateNormal, num_steps=num_steps)
    parts = list(zip(np.array_split(X, 4), np.array_split(y, 4)))
    sizes = set()  # the first batch (the model's own prior) is a program of its own
    for xb, yb in parts:
        t0 = time.perf_counter()
        stream.update(jnp.asarray(xb), jnp.asarray(yb))
        new = "" if stream.num_batches == 1 else " (a new size: compiles)" if len(yb) not in sizes else " (same size)"
        sizes.add(len(yb))
        print(f"   {stream.reports[-1]} ({len(yb)} rows{new}, {time.perf_counter() - t0:.2f} s)")
    gaps = [r.projection_gap for r in stream.reports]
    print(f"   projection errors add up to {sum(gaps):.3g} nats over the stream")

    guide = AutoMultivariateNormal(regression)
    t0 = time.perf_counter()
    one = online.as_prior(guide, nb.fit(regression, guide, jnp.asarray(X), jnp.asarray(y), num_steps=num_steps,
                                        progress_bar=False).params)
    print(f"   one fit on all {len(y)} rows: {time.perf_counter() - t0:.2f} s")
    mcmc = MCMC(NUTS(regression), num_warmup=500, num_samples=num_samples, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(1), jnp.asarray(X), jnp.asarray(y))
    draws = mcmc.get_samples()
    w_nuts, sd_nuts = np.asarray(draws["w"]).mean(0), np.asarray(draws["w"]).std(0)
    sigma_nuts = float(np.median(np.asarray(draws["sigma"])))
    for label, prior in (("stream (4 batches)", stream.prior), ("one fit, all data", one)):
        w, sd, sigma = moments(prior)
        print(f"   {label:>18}: |mean - NUTS| <= {np.max(np.abs(w - w_nuts) / sd_nuts):.3f} NUTS sd, "
              f"sd / NUTS sd in [{np.min(sd / sd_nuts):.3f}, {np.max(sd / sd_nuts):.3f}], "
              f"sigma median {sigma:.4f} (NUTS {sigma_nuts:.4f})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and NUTS draws (a smoke test)")
    args = parser.parse_args()
    jax.config.update("jax_enable_x64", True)
    warnings.simplefilter("ignore", FutureWarning)
    X, y = data()
    exact_part(X, y)
    approximate_part(X, y, 200 if args.quick else 500, 500 if args.quick else 4000)


if __name__ == "__main__":
    main()

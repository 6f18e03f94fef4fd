"""The Lie-group BLR on a NumPyro model with its defaults: linear regression on scikit-learn's diabetes data.

    python examples/liegroup_regression.py [--steps 1000]

``nb.LieGroupGuide(model)`` (affine group, Gaussian base; the positive ``sigma`` as the affine group on its log)
fitted by ``nb.LieGroupBLR()`` with no step size to choose, beside ``nb.BLR()`` + ``AutoNormal`` (the mean-field
Gaussian optimum the Lie-group guide should reach) and a NUTS chain. Printed: each fit's ELBO (1,000 draws, the
same random numbers), the median of ``sigma`` and the largest coefficient error in NUTS posterior sds, and the
end-of-run report of the Lie-group fit (docs/lie-group.md).
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.infer import MCMC, NUTS, SVI, Trace_ELBO
from numpyro.infer.autoguide import AutoNormal
from sklearn.datasets import load_diabetes

import numpyro_blr as nb


def model(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    with numpyro.plate("rows", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, sigma), obs=y)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000)
    args = ap.parse_args()
    numpyro.enable_x64()
    data = load_diabetes()
    X = (data.data - data.data.mean(0)) / data.data.std(0)
    X = jnp.asarray(np.hstack([np.ones((X.shape[0], 1)), X]))  # intercept + 10 standardised columns
    y = jnp.asarray((data.target - data.target.mean()) / data.target.std())

    mcmc = MCMC(NUTS(model), num_warmup=1000, num_samples=2000, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(0), X, y)
    ref = mcmc.get_samples()
    ref_mean, ref_sd = ref["w"].mean(0), ref["w"].std(0)

    fits = {
        "LieGroupGuide + LieGroupBLR()": (nb.LieGroupGuide(model), nb.LieGroupBLR()),
        "AutoNormal + BLR()": (AutoNormal(model), nb.BLR()),
    }
    elbo = Trace_ELBO(num_particles=1000)
    print(f"diabetes: {X.shape[0]} rows, {X.shape[1]} coefficients; {args.steps} steps; NUTS 1000 + 2000\n")
    print(f"{'fit':32s} {'ELBO':>9s} {'sigma median':>13s} {'max |w err| / NUTS sd':>22s}")
    reports = {}
    for name, (guide, optim) in fits.items():
        svi = SVI(model, guide, optim, Trace_ELBO())
        result = svi.run(jax.random.PRNGKey(1), args.steps, X, y, progress_bar=False)
        value = -float(elbo.loss(jax.random.PRNGKey(2), result.params, model, guide, X, y))
        median = guide.median(result.params)
        err = float(jnp.max(jnp.abs(median["w"] - ref_mean) / ref_sd))
        print(f"{name:32s} {value:9.2f} {float(median['sigma']):13.4f} {err:22.3f}")
        reports[name] = (optim, result)
    print(f"{'NUTS':32s} {'':9s} {float(jnp.median(ref['sigma'])):13.4f}")
    optim, result = reports["LieGroupGuide + LieGroupBLR()"]
    print("\n" + str(optim.fit_report(result)))


if __name__ == "__main__":
    main()

"""Mixtures of Gaussians with the BLR: multimodal optimisation and a bimodal posterior fit.

1. Multimodal optimisation (Khan & Rue 2023, Table 1, delta method): 12 components started at
   random points run improved Newton steps in parallel on Himmelblau's function and end at its
   four minima (printed with the function value and mixture weight).
2. Mixture BLR (Lin, Khan & Schmidt 2019): a 2-component full-covariance mixture fitted to the
   unnormalised target 0.3 N(m1, C1) + 0.7 N(m2, C2); prints means, weights and the Monte Carlo
   KL(q || p), against the best single Gaussian fitted with the same code (K = 1).

Run: python examples/multimodal.py   (a few seconds)
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import logsumexp

from numpyro_blr import mixture_blr, multimodal_optimization
from numpyro_blr.mixture import log_prob, modes, weights


def himmelblau(x):
    return (x[0] ** 2 + x[1] - 11.0) ** 2 + (x[0] + x[1] ** 2 - 7.0) ** 2


MU = jnp.array([[-3.0, 0.0], [3.0, 1.0]])
COV = jnp.array([[[1.0, 0.5], [0.5, 1.0]], [[0.5, -0.2], [-0.2, 0.8]]])
W = jnp.array([0.3, 0.7])


def log_target(x):
    d = x - MU
    maha = jnp.einsum("ki,kij,kj->k", d, jnp.linalg.inv(COV), d)
    return logsumexp(jnp.log(W) - 0.5 * maha - 0.5 * jnp.linalg.slogdet(2 * jnp.pi * COV)[1])


def fit(init, steps=300):
    opt = mixture_blr(num_samples=8)  # the default step size; as many components as rows of init
    state = opt.init(jnp.asarray(init, jnp.float32))
    loss = lambda x: -log_target(x)  # noqa: E731
    run = jax.jit(lambda s, key: jax.lax.scan(lambda s, k: opt.step(k, s, loss), s, jax.random.split(key, steps)))
    state, _ = run(state, jax.random.PRNGKey(0))
    x = opt.sample(jax.random.PRNGKey(1), state, 100_000)
    r = np.asarray(log_prob(state, x) - jax.vmap(log_target)(x), np.float64)
    return opt, state, r.mean(), r.std() / np.sqrt(len(r))


def main():
    K = 12
    opt = multimodal_optimization(0.5, K, weight_lr=0.1)
    state = opt.init(jax.random.uniform(jax.random.PRNGKey(0), (K, 2), minval=-5.0, maxval=5.0))
    state, _ = jax.jit(lambda s: jax.lax.scan(lambda s, _: opt.step(None, s, himmelblau), s, None, length=200))(state)
    pis = np.asarray(weights(state))
    print(f"Himmelblau: {K} components found {len(modes(state, tol=1e-2))} distinct minima")
    for m in modes(state, himmelblau, tol=1e-2):
        w = pis[np.linalg.norm(np.asarray(state.means) - m, axis=1) < 1e-2].sum()
        print(f"  x = ({m[0]: .5f}, {m[1]: .5f})   f(x) = {float(himmelblau(jnp.asarray(m))):.2e}   total weight {w:.3f}")

    opt2, st2, kl2, se2 = fit([[-1.0, 0.0], [1.0, 0.0]])
    print("\nBimodal target 0.3 N((-3, 0), C1) + 0.7 N((3, 1), C2):")
    for c in np.argsort(np.asarray(st2.means[:, 0])):
        print(f"  component mean ({float(st2.means[c, 0]): .4f}, {float(st2.means[c, 1]): .4f})"
              f"   weight {float(weights(st2)[c]):.4f}")
    print(f"  KL(q || p), 2 components: {kl2:.5f} +- {se2:.5f}")
    singles = [fit([start]) for start in ([-1.0, 0.0], [1.0, 0.0])]
    best = min(singles, key=lambda s: s[2])
    print(f"  KL(q || p), best single Gaussian: {best[2]:.5f} +- {best[3]:.5f}  (-log 0.7 = {-np.log(0.7):.5f})")


if __name__ == "__main__":
    main()

"""Stochastic VI with minibatches (``numpyro_blr.infer.svi``): the minibatch declared by ``numpyro.plate(...,
subsample_size=...)``, streamed and index-sampled minibatches agree, it reaches full-batch VMP's bound, and a
missing or wrong plate scale raises. The comparison with BayesPy's stochastic VI is in tests/infer/test_bayespy.py."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

from numpyro_blr.infer import ModelError, svi, vmp


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


K, D = 3, 2


def data(n, seed=0):
    rng = np.random.default_rng(seed)
    centers = np.array([[-5.0, 0.0], [0.0, 5.0], [5.0, -1.0]])
    return centers[rng.integers(0, K, n)] + rng.normal(0, 1, (n, D)), centers


def gmm(y, batch=None, size=None):
    """Index-sampled when ``batch`` is given (``y`` the whole data set); streamed when ``size`` is given (``y`` the
    minibatch, the plate's full size ``size``)."""
    n = size or y.shape[0]
    w = numpyro.sample("w", dist.Dirichlet(jnp.ones(K)))
    with numpyro.plate("k", K):
        mu = numpyro.sample("mu", dist.Normal(0.0, 10.0).expand([D]).to_event(1))
        tau = numpyro.sample("tau", dist.Gamma(1.0, 1.0).expand([D]).to_event(1))
    with numpyro.plate("n", n, subsample_size=batch or y.shape[0]) as idx:
        z = numpyro.sample("z", dist.Categorical(w))
        obs = y if size else y[idx]
        numpyro.sample("y", dist.Normal(mu[z], 1.0 / jnp.sqrt(tau[z])).to_event(1), obs=obs)


def init(centers):
    return {"mu": dist.Normal(jnp.asarray(centers) + 0.5, 1.0).to_event(1)}


@pytest.mark.slow
def test_streamed_and_index_sampled_minibatches_agree_and_reach_full_vmp():
    y, centers = data(3000)
    b = 100
    algo = svi(gmm, jnp.asarray(y), b, kappa=0.7, tau=1.0)
    assert algo.engine.local == ["z"] and sorted(algo.engine.globals) == ["mu", "tau", "w"]
    streamed = svi(gmm, jnp.asarray(y[:b]), None, 3000)
    rng = np.random.default_rng(1)
    s1, s2 = algo.init(init=init(centers)), streamed.init(init=init(centers))
    for _ in range(5):
        idx = rng.choice(3000, b, replace=False)
        s1, _ = algo.step(None, s1, indices=idx)
        s2, _ = streamed.step(None, s2, jnp.asarray(y[idx]), None, 3000)
    for n in s1.natural:
        for a, c in zip(s1.natural[n], s2.natural[n]):
            np.testing.assert_allclose(a, c, rtol=1e-10, atol=1e-10)
    res = algo.run(algo.init(init=init(centers)), key=jax.random.PRNGKey(0), num_epochs=3, progress_bar=False)
    assert res.num_steps == 90
    elbo, _ = algo.elbo(res.state)
    full = vmp(gmm, jnp.asarray(y), order=("z", "w", "mu", "tau"))
    ref = full.run(full.init(init=init(centers)), tol=1e-8, progress_bar=False)
    assert abs(elbo - ref.elbo) < 5e-3 * abs(ref.elbo)
    np.testing.assert_allclose(np.sort(np.asarray(res.posterior["mu"].mean)[:, 0]), np.sort(centers[:, 0]), atol=0.3)


def test_missing_plate_scale_raises():
    y, _ = data(200)

    def no_subsample(y):  # a minibatch passed to a plate of its own size: counted as the whole data set
        mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
        with numpyro.plate("n", y.shape[0]):
            numpyro.sample("y", dist.Normal(mu, 1.0), obs=y[:, 0])

    with pytest.raises(ModelError, match=r"no numpyro.plate of the model declares subsample_size.*over-confident"):
        svi(no_subsample, jnp.asarray(y[:20]))

    def outside(y, batch):  # a minibatch-sized observation outside the subsampled plate: not scaled by N/B
        mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
        with numpyro.plate("n", y.shape[0], subsample_size=batch) as idx:
            numpyro.sample("y", dist.Normal(mu, 1.0), obs=y[idx, 0])
        numpyro.sample("y2", dist.Normal(mu, 1.0).expand([batch]).to_event(1), obs=y[:batch, 1])

    with pytest.raises(ModelError, match=r"observed site 'y2' has an axis of the minibatch size 20 .*not scaled by N/B"):
        svi(outside, jnp.asarray(y), 20)


@pytest.mark.slow
def test_step_size_arguments():
    y, _ = data(100)
    with pytest.raises(ValueError, match=r"kappa must be in \(0.5, 1\]"):
        svi(gmm, jnp.asarray(y), 10, kappa=0.4)

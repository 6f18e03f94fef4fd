"""VOGN / OGN (Khan et al. 2018; Osawa et al. 2019)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from numpyro_blr.deep import gauss_newton_from_grads, ogn, per_example_grads, vogn


def _per_example_loss(p, x, y):
    logits = jnp.tanh(x @ p["w1"]) @ p["w2"] + p["b"]
    return -jax.nn.log_softmax(logits)[y]


def _setup(seed=0, M=6):
    rng = np.random.default_rng(seed)
    params = {
        "w1": rng.standard_normal((4, 5)).astype(np.float32),
        "w2": rng.standard_normal((5, 3)).astype(np.float32),
        "b": np.zeros(3, np.float32),
    }
    x = rng.standard_normal((M, 4)).astype(np.float32)
    y = rng.integers(0, 3, M)
    return params, x, y


def test_curvature_is_mean_of_per_example_squared_grads_one_by_one():
    params, x, y = _setup()
    lr, lam, b1, b2, s0 = 0.1, 0.01, 0.9, 0.8, 0.5
    opt = ogn(lr, weight_decay=lam, beta1=b1, beta2=b2, hess_init=s0)
    state = opt.init(params)
    new, info = jax.jit(lambda s: opt.step(None, s, _per_example_loss, x, y))(state)
    loss = info.loss
    curv = new.tree(new.precision - lam)  # VOGN's s: the per-example precision minus the weight decay
    # one example at a time, in numpy
    gs = [jax.tree.map(np.asarray, jax.grad(_per_example_loss)(params, x[i], y[i])) for i in range(len(y))]
    for k in params:
        g = np.stack([gi[k] for gi in gs]).astype(np.float64)
        s = b2 * s0 + (1 - b2) * np.mean(g**2, axis=0)
        mom = (1 - b1) * np.mean(g, axis=0)
        mu = params[k] - lr * (mom / (1 - b1) + lam * params[k]) / (s + lam)
        np.testing.assert_allclose(curv[k], s, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(new.tree(new.momentum)[k], mom, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(new.params[k], mu, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loss, np.mean([_per_example_loss(params, x[i], y[i]) for i in range(len(y))]), rtol=1e-5)


N, LAM = 1000.0, 1e-3
VOGN_OPT = vogn(0.05, ess=N, weight_decay=LAM, hess_init=2.0, mc_samples=2)
_PARAMS, _X, _Y = _setup(1, M=32)
_STEP = jax.jit(lambda k, s: VOGN_OPT.step(k, s, _per_example_loss, _X, _Y))


@pytest.mark.slow
def test_vogn_step_samples_with_the_right_variance_and_uses_them():
    opt, state, key = VOGN_OPT, VOGN_OPT.init(_PARAMS), jax.random.key(0)
    new, _ = _STEP(key, state)

    @jax.jit
    def manual_step(key, state):
        draws = opt.sample(key, state, 2)  # draw s with jax.random.split(key, 2)[s], as step's samples
        thetas = [jax.tree.map(lambda a: a[i], draws) for i in range(2)]
        grads = [per_example_grads(_per_example_loss, th, _X, _Y) for th in thetas]
        return opt.update(state, gauss_newton_from_grads(state, grads))[0]

    manual = manual_step(key, state)
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(manual)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # sigma^2 = 1/(N (s + lam)) = 1/(1000 * 2.001); 8000 draws: relative s.e. of the s.d. is 0.8%
    noise = opt.sample(jax.random.key(1), opt.init({"a": jnp.zeros(8000)}), 1)
    np.testing.assert_allclose(np.std(noise["a"]), 1 / np.sqrt(N * (2.0 + LAM)), rtol=0.04)


@pytest.mark.slow
def test_ogn_does_not_sample_and_vogn_trains():
    o = ogn(0.1)
    state = o.init(_PARAMS)
    theta = o.sample(jax.random.key(0), state, 1)
    noise = jax.tree.map(lambda a, m: a[0] - m, theta, state.params)
    assert all(np.all(np.asarray(n) == 0) for n in jax.tree.leaves(noise))
    state, losses = VOGN_OPT.init(_PARAMS), []
    for k in jax.random.split(jax.random.key(0), 150):
        state, info = _STEP(k, state)
        losses.append(float(info.loss))
    assert np.mean(losses[-10:]) < 0.7 * np.mean(losses[:10])
    assert np.all(np.asarray(state.precision) - LAM > 0)


def test_nonfinite_skip_and_bad_input():
    opt = vogn(0.1, ess=10.0)
    state = opt.init({"a": jnp.ones(2)})
    bad, info = opt.update(state, gauss_newton_from_grads(state, {"a": jnp.array([[1.0, jnp.inf]])}))
    assert bool(info.skipped) and int(bad.skipped) == 1 and int(bad.count) == 0
    np.testing.assert_array_equal(bad.precision, state.precision)
    with pytest.raises(ValueError, match="ess"):
        vogn(0.1)
    with pytest.raises(ValueError, match="lr"):
        vogn(-0.1, ess=10.0)
    with pytest.raises(ValueError, match="weight_decay"):
        ogn(0.1, weight_decay=-1.0)
    with pytest.raises(ValueError, match="beta2"):
        ogn(0.1, beta2=1.0)
    with pytest.raises(ValueError, match="example axis"):
        gauss_newton_from_grads(state, {"a": jnp.ones(2)})
    with pytest.raises(ValueError, match="mixes dtypes"):
        opt.init({"a": jnp.ones(2), "b": jnp.ones(2, jnp.float16)})

"""nb.as_optax: the diagonal rows as optax transformations, for Flax / Equinox training loops."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import numpyro_blr as nb
from numpyro_blr.deep import gauss_newton_from_grads, per_example_grads, price_from_samples

PARAMS = {"w": jnp.asarray(np.random.default_rng(0).standard_normal((3, 2)), jnp.float32), "b": jnp.zeros(2)}
X = jnp.asarray(np.random.default_rng(1).standard_normal((8, 3)), jnp.float32)
Y = jnp.asarray(np.random.default_rng(2).standard_normal((8, 2)), jnp.float32)


def loss(p, x, y):
    return jnp.mean(jnp.sum((jnp.tanh(x @ p["w"]) + p["b"] - y) ** 2, -1))


def per_example_loss(p, x, y):
    return jnp.sum((jnp.tanh(x @ p["w"]) + p["b"] - y) ** 2)


def _view_run(algo, steps, **extra_fn):
    tx = nb.as_optax(algo)

    @jax.jit
    def step(p, s):
        theta = nb.perturbed(algo, p, s)
        extra = {k: f(theta) for k, f in extra_fn.items()}
        updates, s2 = tx.update(jax.grad(loss)(theta, X, Y), s, p, **extra)
        return optax.apply_updates(p, updates), s2, theta

    p, s, thetas = PARAMS, tx.init(PARAMS), []
    for _ in range(steps):
        p, s, theta = step(p, s)
        thetas.append(theta)
    return p, s, thetas


@pytest.mark.parametrize("make, ref", [
    (lambda: nb.adam_blr(1e-2), lambda: optax.adam(1e-2)),
    (lambda: nb.rmsprop_blr(1e-3), lambda: optax.rmsprop(1e-3)),
    (lambda: nb.sgd_blr(0.1, momentum=0.9), lambda: optax.sgd(0.1, momentum=0.9)),
])
def test_delta_rows_are_their_optax_optimizer(make, ref):
    ours, _, thetas = _view_run(make(), 30)
    tx = ref()
    p, s = PARAMS, tx.init(PARAMS)
    for _ in range(30):
        u, s = tx.update(jax.grad(loss)(p, X, Y), s, p)
        p = optax.apply_updates(p, u)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(p)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    # the delta method evaluates the gradient at the mean: perturbed() is the identity
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(thetas[0]), jax.tree.leaves(PARAMS)))


def test_ivon_view_equals_the_algorithm_on_the_same_draws():
    algo = nb.ivon(0.1, ess=8.0, hess_init=0.5, beta2=0.9)
    ours, view_state, thetas = _view_run(algo, 5)
    state = algo.init(PARAMS)
    for theta in thetas:  # the draws the view handed out, fed to the algorithm's rule
        noise = jax.tree.map(jnp.subtract, theta, state.params)
        state, _ = algo.update(state, price_from_samples(state, jax.grad(loss)(theta, X, Y), noise, 8.0))
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(state.params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(view_state.precision, state.precision, rtol=1e-5)
    # fresh noise at every step, and of the posterior's scale sigma = 1/sqrt(ess p)
    d0 = jax.tree.map(jnp.subtract, thetas[1], thetas[0])
    assert not np.allclose(d0["w"], 0.0)


def test_vogn_view_takes_the_per_example_squared_gradients():
    algo = nb.vogn(0.05, ess=8.0, hess_init=1.0)
    sq = lambda theta: jax.tree.map(lambda g: jnp.mean(g**2, 0) / 1.0, per_example_grads(per_example_loss, theta, X, Y))
    # the view's gradient is the batch mean of the per-example gradients of the same loss
    ours, _, thetas = _view_run(algo, 3, squared_grads=sq)
    state = algo.init(PARAMS)
    for theta in thetas:
        state, _ = algo.update(state, gauss_newton_from_grads(state, per_example_grads(per_example_loss, theta, X, Y)))
    # loss() is the mean of per_example_loss, so both see the same gradient and squared gradients
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(state.params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="squared_grads"):
        tx = nb.as_optax(algo)
        tx.update(PARAMS, tx.init(PARAMS), PARAMS)


def test_bsam_has_no_one_gradient_view_and_params_are_required():
    with pytest.raises(ValueError, match="two gradient"):
        nb.as_optax(nb.bsam(0.1, ess=10.0))
    tx = nb.as_optax(nb.adam_blr(1e-3))
    with pytest.raises(ValueError, match="params"):
        tx.update(PARAMS, tx.init(PARAMS))


@pytest.mark.slow
def test_equinox_training_loop_with_ivon():
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.MLP(3, 2, 8, 1, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    target = jnp.tanh(X @ jnp.asarray([[1.0, -1.0], [0.5, 0.2], [-0.3, 0.8]]))  # learnable
    algo = nb.ivon(0.1, ess=1000.0, hess_init=1.0, beta2=0.999)
    tx = nb.as_optax(algo)
    opt_state = tx.init(params)

    def eqx_loss(p):
        m = eqx.combine(p, static)
        return jnp.mean(jnp.sum((jax.vmap(m)(X) - target) ** 2, -1))

    @jax.jit
    def step(p, s):
        theta = nb.perturbed(algo, p, s)
        u, s = tx.update(jax.grad(eqx_loss)(theta), s, p)
        return optax.apply_updates(p, u), s

    start = float(eqx_loss(params))
    for _ in range(300):
        params, opt_state = step(params, opt_state)
    assert float(eqx_loss(params)) < 0.1 * start  # at the mean
    assert int(opt_state.skipped) == 0 and int(opt_state.count) == 300

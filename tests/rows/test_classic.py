"""Table 1 of Khan & Rue (2023): SGD, RMSprop and Adam written as BLR updates reproduce optax."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from numpyro_blr.deep import adam_blr, gradient_from_grads, rmsprop_blr, sgd_blr
from numpyro_blr.families import DiagonalGaussian

T = 50


def _grad_sequence(seed=0):
    rng = np.random.default_rng(seed)
    # gradients over several orders of magnitude, as in a real network
    scales = {"w": 10.0 ** rng.uniform(-4, 1, (3, 4)), "b": 10.0 ** rng.uniform(-4, 1, 4)}
    return [
        {k: (v * rng.standard_normal(v.shape)).astype(np.float32) for k, v in scales.items()} for _ in range(T)
    ]


def _params(seed=1):
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((3, 4)).astype(np.float32), "b": rng.standard_normal(4).astype(np.float32)}


def _run_optax(tx, params, grads):
    @jax.jit
    def run(params, grads):
        def body(carry, g):
            p, s = carry
            u, s = tx.update(g, s, p)
            p = optax.apply_updates(p, u)
            return (p, s), p

        return jax.lax.scan(body, (params, tx.init(params)), grads)[1]

    return run(params, grads)


def _run_blr(opt, params, grads):
    @jax.jit
    def run(params, grads):
        def body(state, g):
            state, _ = opt.update(state, gradient_from_grads(state, g, squared=True))
            return state, state.params

        return jax.lax.scan(body, opt.init(params), grads)[1]

    return run(params, grads)


CASES = [
    (lambda: optax.sgd(0.1), lambda: sgd_blr(0.1)),
    (lambda: optax.sgd(0.1, momentum=0.9), lambda: sgd_blr(0.1, momentum=0.9)),
    (lambda: optax.sgd(0.05, momentum=0.8, nesterov=True), lambda: sgd_blr(0.05, momentum=0.8, nesterov=True)),
    (lambda: optax.adam(1e-2), lambda: adam_blr(1e-2)),
    (lambda: optax.adam(3e-3, b1=0.5, b2=0.9, eps=1e-6), lambda: adam_blr(3e-3, b1=0.5, b2=0.9, eps=1e-6)),
    (lambda: optax.rmsprop(1e-3), lambda: rmsprop_blr(1e-3)),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_reproduces_optax_on_the_same_gradients(case):
    make_tx, make_blr = CASES[case]
    params, grads = _params(), _grad_sequence()
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *grads)
    ref = _run_optax(make_tx(), params, stacked)
    ours = _run_blr(make_blr(), params, stacked)
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(ours)):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-6)


@pytest.mark.parametrize("which", ["sgd", "adam"])
def test_reproduces_optax_trajectory_on_a_loss(which):
    # gradients evaluated at each optimizer's own iterate: the trajectories must still agree
    rng = np.random.default_rng(3)
    x, y = rng.standard_normal((32, 3)).astype(np.float32), rng.standard_normal((32, 4)).astype(np.float32)
    loss = lambda p: jnp.mean((jnp.tanh(x @ p["w"]) + p["b"] - y) ** 2)
    tx, opt = (optax.sgd(0.1, momentum=0.9), sgd_blr(0.1, momentum=0.9)) if which == "sgd" else (optax.adam(1e-2), adam_blr(1e-2))
    p, s = _params(), tx.init(_params())
    state = opt.init(_params())

    @jax.jit
    def both(p, s, state):
        u, s = tx.update(jax.grad(loss)(p), s, p)
        state, _ = opt.step(None, state, loss)
        return optax.apply_updates(p, u), s, state

    for _ in range(T):
        p, s, state = both(p, s, state)
    assert int(state.count) == T
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(state.params)):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-6)


def test_adam_state_is_the_natural_parameter():
    # lambda2 = -S/2 where S is optax's second moment nu (exactly: scaling by 2 is exact in binary)
    params, grads = _params(), _grad_sequence()[:5]
    tx, opt = optax.adam(1e-2), adam_blr(1e-2)
    s, state = tx.init(params), opt.init(params)
    for g in grads:
        _, s = tx.update(g, s, params)
        state, _ = opt.update(state, gradient_from_grads(state, g, squared=True))
    # the state's precision p is the Gaussian's: its natural parameter is lambda2 = -p/2
    nat2 = state.tree(DiagonalGaussian.to_natural(state.mean, state.precision).eta2)
    for nu, lam2 in zip(jax.tree.leaves(s[0].nu), jax.tree.leaves(nat2)):
        np.testing.assert_array_equal(-2.0 * np.asarray(lam2), np.asarray(nu))


def test_bad_input():
    with pytest.raises(ValueError, match="lr"):
        sgd_blr(-1.0)
    with pytest.raises(ValueError, match="b2"):
        adam_blr(1e-3, b2=1.5)
    with pytest.raises(ValueError, match="momentum"):
        sgd_blr(0.1, momentum=1.0)
    with pytest.raises(ValueError, match="mixes dtypes"):
        adam_blr(1e-3).init({"a": jnp.zeros(2), "b": jnp.zeros(2, jnp.bfloat16)})

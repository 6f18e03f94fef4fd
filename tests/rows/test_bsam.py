"""Bayesian SAM (Moellenhoff & Khan 2023) checked against Algorithm 1 written out in numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from numpyro_blr.deep import bsam, predictive, sharpness_aware_from_grads, sharpness_point
from numpyro_blr.estimators.weights import draw

SHAPES = {"w": (2, 3), "b": (3,)}
HYPER = dict(lr=0.05, ess=40.0, radius=0.1, beta1=0.8, beta2=0.7, weight_decay=0.02, damping=0.3, s_init=2.0)


def _tree(rng, scale=1.0):
    return {k: (scale * rng.standard_normal(s)).astype(np.float32) for k, s in SHAPES.items()}


def _numpy_bsam(w, s, gm, grads, pgrads, *, lr, b1, b2, delta, damping):
    """One bSAM step (Algorithm 1), float64; grads / pgrads have a leading group axis."""
    gs = np.mean(np.sqrt(s) * np.abs(grads), axis=0)
    g_rho = np.mean(pgrads, axis=0)
    gm = b1 * gm + (1 - b1) * (g_rho + delta * w)
    s = b2 * s + (1 - b2) * (gs + delta + damping)
    w = w - lr * gm / s
    return w, s, gm


def _update(opt, grads, perturbed_grads, state):
    """The rule alone on bSAM's statistics of gradients at the samples and at the adversarial points."""
    return opt.update(state, sharpness_aware_from_grads(state, grads, perturbed_grads, HYPER["damping"]))


@pytest.mark.parametrize("groups", [1, 3])
def test_update_matches_hand_equations(groups):
    rng = np.random.default_rng(0)
    opt = bsam(**HYPER)
    update = jax.jit(lambda g, p, s: _update(opt, g, p, s)[0])
    w0 = _tree(rng)
    state = opt.init(w0)
    ref = {k: (w0[k].astype(np.float64), np.full(s, HYPER["s_init"]), np.zeros(s)) for k, s in SHAPES.items()}
    for _ in range(4):
        grads = [_tree(rng, 2.0) for _ in range(groups)]
        pgrads = [_tree(rng, 2.0) for _ in range(groups)]
        state = update(grads if groups > 1 else grads[0], pgrads if groups > 1 else pgrads[0], state)
        for k in SHAPES:
            G = np.stack([g[k] for g in grads]).astype(np.float64)
            P = np.stack([g[k] for g in pgrads]).astype(np.float64)
            ref[k] = _numpy_bsam(*ref[k], G, P, lr=HYPER["lr"], b1=HYPER["beta1"], b2=HYPER["beta2"],
                                 delta=HYPER["weight_decay"], damping=HYPER["damping"])
            got = (state.params[k], state.tree(state.precision)[k], state.tree(state.momentum)[k])
            for got, want in zip(got, ref[k]):
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert int(state.count) == 4 and int(state.skipped) == 0


def test_one_step_numbers_by_hand():
    # w=1, s=4, gm=0, g=-2 (at the sample), g_rho=3, lr=0.5, b1=0.9, b2=0.5, delta=0.1, damping=0.2:
    # gm = 0.1*(3 + 0.1) = 0.31; s = 0.5*4 + 0.5*(2*2 + 0.1 + 0.2) = 4.15; w = 1 - 0.5*0.31/4.15
    opt = bsam(lr=0.5, ess=10.0, beta1=0.9, beta2=0.5, weight_decay=0.1, damping=0.2, s_init=4.0)
    init = opt.init({"x": jnp.array(1.0)})
    st, _ = opt.update(init, sharpness_aware_from_grads(init, {"x": jnp.array(-2.0)}, {"x": jnp.array(3.0)}, 0.2))
    np.testing.assert_allclose(st.tree(st.momentum)["x"], 0.31, rtol=1e-6)
    np.testing.assert_allclose(st.tree(st.precision)["x"], 4.15, rtol=1e-6)
    np.testing.assert_allclose(st.params["x"], 1 - 0.5 * 0.31 / 4.15, rtol=1e-6)


def test_step_on_quadratic_matches_numpy():
    # loss = 0.5 * sum a (theta - c)^2: grad a (theta - c); the whole step (sample, perturb w + rho g/s,
    # gradient there, update) in numpy with the noise the optimizer draws.
    rng = np.random.default_rng(1)
    a = rng.uniform(0.5, 2.0, 5).astype(np.float32)
    c = rng.standard_normal(5).astype(np.float32)
    loss = lambda p: 0.5 * jnp.sum(a * (p - c) ** 2)
    opt = bsam(**HYPER)
    state = opt.init(jnp.zeros(5))
    w, s, gm = np.zeros(5), np.full(5, HYPER["s_init"]), np.zeros(5)
    step = jax.jit(lambda k, st: opt.step(k, st, loss))
    for t in range(3):
        key = jax.random.key(t)
        noise = opt.sample(key, state, 1)[0] - state.params  # step's draw: jax.random.split(key, 1)[0]
        eps = np.asarray(noise, np.float64) * np.sqrt(HYPER["ess"] * s)
        state, info = step(key, state)
        l = info.loss
        g = a * (w + eps / np.sqrt(HYPER["ess"] * s) - c)
        wp = w + HYPER["radius"] * g / s
        gr = a * (wp - c)
        np.testing.assert_allclose(l, 0.5 * np.sum(a * (wp - c) ** 2), rtol=1e-4)
        w, s, gm = _numpy_bsam(w, s, gm, g[None], gr[None], lr=HYPER["lr"], b1=HYPER["beta1"], b2=HYPER["beta2"],
                               delta=HYPER["weight_decay"], damping=HYPER["damping"])
        np.testing.assert_allclose(state.params, w, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(state.precision, s, rtol=1e-5)


def test_msharpness_splits_the_batch():
    x = jnp.asarray(np.random.default_rng(2).standard_normal((6, 2)), jnp.float32)
    loss = lambda p, x: jnp.mean((x @ p - 1.0) ** 2)
    opt = bsam(**HYPER, msharpness=3)
    state = opt.init(jnp.ones(2))
    key = jax.random.key(0)
    new, info = jax.jit(lambda k, s: opt.step(k, s, loss, x))(key, state)
    l = info.loss
    gs, gr, ls = [], [], []
    for k, xg in zip(jax.random.split(key, 3), x.reshape(3, 2, 2)):
        th = state.layout.unravel(draw(k, state, HYPER["ess"], "jax")[0])  # the group's own draw
        g = jax.grad(loss)(th, xg)
        lg, g_rho = jax.value_and_grad(loss)(sharpness_point(state, g, HYPER["radius"]), xg)
        gs.append(g), gr.append(g_rho), ls.append(lg)
    manual, _ = _update(opt, gs, gr, state)
    np.testing.assert_allclose(new.params, manual.params, rtol=1e-5)
    np.testing.assert_allclose(new.precision, manual.precision, rtol=1e-5)
    np.testing.assert_allclose(l, np.mean(ls), rtol=1e-5)
    with pytest.raises(ValueError, match="divisible"):
        opt.step(key, state, loss, x[:5])


def test_nonfinite_skipped_and_bad_hyperparameters():
    opt = bsam(**HYPER)
    state = opt.init({"x": jnp.ones(3)})
    bad, info = _update(opt, {"x": jnp.array([1.0, jnp.nan, 1.0])}, {"x": jnp.ones(3)}, state)
    assert bool(info.skipped) and int(bad.skipped) == 1 and int(bad.count) == 0
    np.testing.assert_array_equal(bad.params["x"], state.params["x"])
    for kwargs, match in [(dict(lr=0.1), "ess"), (dict(lr=0.1, ess=10.0, radius=-1.0), "radius"),
                          (dict(lr=0.1, ess=10.0, msharpness=0), "msharpness"),
                          (dict(lr=0.1, ess=10.0, s_init=0.0), "s_init")]:
        with pytest.raises(ValueError, match=match):
            bsam(**kwargs)


def test_learns_a_quadratic_posterior_mean():
    # with rho -> small and a quadratic, w goes to the minimiser of loss + delta/2 |w|^2
    a = jnp.asarray([1.0, 2.0, 0.5])
    c = jnp.asarray([1.0, -1.0, 2.0])
    loss = lambda p: 0.5 * jnp.sum(a * (p - c) ** 2)
    opt = bsam(lr=0.2, ess=1000.0, rho=1e-3, beta2=0.99, weight_decay=1e-3, damping=0.0)
    body = lambda s, k: (opt.step(k, s, loss)[0], None)
    state, _ = jax.jit(lambda s: jax.lax.scan(body, s, jax.random.split(jax.random.key(0), 3000)))(opt.init(jnp.zeros(3)))
    np.testing.assert_allclose(state.params, a * c / (a + 1e-3), atol=0.05)
    pred = predictive(jax.random.key(1), state, lambda p, x: p * x, jnp.ones(3), 8, sample=opt.sample)
    assert pred.shape == (3,) and np.all(np.isfinite(pred))

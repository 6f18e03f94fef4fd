"""The accelerator layout of the network rows' steps (numpyro_blr.tree.fused_passes), checked on CPU.

On a GPU the steps recompute their counter-hash noise where it is read and decide a skip from the estimate before
the update; on CPU they store the noise and decide after. The CI machine has no accelerator, so these tests switch
the layout on by hand and check that it computes the same steps as the CPU layout, and skips as documented.
"""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
import optax
import pytest

import numpyro_blr as nb
import numpyro_blr.tree as tree
from numpyro_blr.deep import ivon, price_from_samples
from numpyro_blr.tree import NoiseSlices, hash_normal, hash_normal_at, hash_uniform, hash_uniform_at

PARAMS = {"w1": np.random.default_rng(0).standard_normal((5, 7)).astype(np.float32) * 0.3,
          "b1": np.zeros(7, np.float32), "w2": np.random.default_rng(1).standard_normal((7, 3)).astype(np.float32) * 0.3}
X = jnp.asarray(np.random.default_rng(2).standard_normal((16, 5)), jnp.float32)
Y = jnp.asarray(np.random.default_rng(3).integers(0, 3, 16), jnp.int32)


def loss_fn(params, x, y):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return optax.softmax_cross_entropy_with_integer_labels(h @ params["w2"], y).mean()


@pytest.fixture
def fused(monkeypatch):
    monkeypatch.setattr(tree, "fused_passes", lambda: True)


@pytest.mark.parametrize("n", [1, 2, 7, 10, 1001])
@pytest.mark.slow
def test_hash_draws_by_slice_equal_the_whole_draw(n):
    key = jax.random.key(n)
    z, u = np.asarray(hash_normal(key, n)), np.asarray(hash_uniform(key, n))
    words4, words2 = jax.random.bits(key, (4,), jnp.uint32), jax.random.bits(key, (2,), jnp.uint32)
    for start in sorted({0, n // 3, n // 2, (n + 1) // 2, n - 1} - {n}):
        for size in sorted({1, n - start}):
            np.testing.assert_allclose(np.asarray(hash_normal_at(words4, start, size, n)), z[start:start + size],
                                       rtol=1e-6, atol=1e-6)
            np.testing.assert_array_equal(np.asarray(hash_uniform_at(words2, start, size)), u[start:start + size])
    for regenerate in (False, True):  # the two ways NoiseSlices reads the same draw
        slices = NoiseSlices(key, n, jnp.float32, "hash", regenerate=regenerate)
        np.testing.assert_allclose(np.asarray(slices.all()), z, rtol=1e-6, atol=1e-6)


ROWS = {
    "ivon": lambda: ivon(lr=0.05, ess=200.0, hess_init=0.5, weight_decay=1e-3),
    "ivon_mc2": lambda: ivon(lr=0.05, ess=200.0, hess_init=0.5, mc_samples=2),
    "lie_additive": lambda: nb.lie_additive(0.05, momentum=0.9, base=dist.Normal(0.0, 0.05)),
    "lie_affine": lambda: nb.lie_affine(0.05, ess=200.0),
    "lie_multiplicative": lambda: nb.lie_multiplicative(0.05, ess=200.0),
}


def _run(algo, steps=4):
    state = algo.init(PARAMS)
    step = jax.jit(lambda k, s: algo.step(k, s, loss_fn, X, Y))
    for i in range(steps):
        state, info = step(jax.random.key(i), state)
        assert not bool(info.skipped)
    return state


@pytest.mark.parametrize("row", [r if r in ("ivon", "lie_additive") else pytest.param(r, marks=pytest.mark.slow) for r in sorted(ROWS)])
def test_accelerator_layout_takes_the_same_steps(row, monkeypatch):
    cpu = _run(ROWS[row]())
    monkeypatch.setattr(tree, "fused_passes", lambda: True)
    acc = _run(ROWS[row]())
    for a, b in zip(jax.tree.leaves(cpu), jax.tree.leaves(acc)):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_accelerator_layout_optax_view_equals_the_update_on_its_draw(fused):
    algo = ivon(lr=0.05, ess=200.0, hess_init=0.5)
    tx = nb.as_optax(algo, seed=0)
    params, opt_state, state = PARAMS, tx.init(PARAMS), algo.init(PARAMS)
    draw = jax.jit(lambda p, o: nb.perturbed(algo, p, o))
    view = jax.jit(lambda g, o, p: tx.update(g, o, p))
    for _ in range(3):
        weights = draw(params, opt_state)
        grads = jax.grad(loss_fn)(weights, X, Y)
        noise = state.layout.ravel(weights) - state.mean  # the view's draw, read back
        state, _ = algo.update(state, price_from_samples(state, [grads], [state.layout.unravel(noise)], 200.0))
        updates, opt_state = view(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(state.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("layout", ["cpu", "accelerator"])
def test_a_non_finite_estimate_skips_the_whole_step(layout, monkeypatch):
    if layout == "accelerator":
        monkeypatch.setattr(tree, "fused_passes", lambda: True)
    opt = ivon(lr=0.05, ess=50.0, hess_init=0.3, weight_decay=1e-2)
    state = opt.init({"x": jnp.ones(3)})
    update = jax.jit(lambda g, n, s: opt.update(s, price_from_samples(s, g, n, 50.0)))
    good, _ = update({"x": jnp.ones(3)}, {"x": 0.1 * jnp.ones(3)}, state)
    bad, info = update({"x": jnp.array([1.0, jnp.nan, 1.0])}, {"x": 0.1 * jnp.ones(3)}, good)
    assert bool(info.skipped) and int(bad.skipped) == 1 and int(bad.count) == 1
    for a, b in zip((good.mean, good.precision, good.momentum), (bad.mean, bad.precision, bad.momentum)):
        np.testing.assert_array_equal(a, b)
    # a step's own estimator: a NaN in the loss's gradient (Estimate.check) skips it
    algo = ivon(lr=0.05, ess=50.0, hess_init=0.3)
    s0 = algo.init({"x": jnp.ones(3)})
    s1, info = jax.jit(lambda s: algo.step(jax.random.key(0), s, lambda p: jnp.sum(jnp.sqrt(p["x"] - 1.0))))(s0)
    assert bool(info.skipped) and int(s1.skipped) == 1
    np.testing.assert_array_equal(s1.mean, s0.mean)


def test_accelerator_layout_keeps_an_overflowing_entry(fused):
    """A finite estimate whose step overflows in one entry: that entry keeps its state, the others step."""
    opt = ivon(lr=0.05, ess=50.0, hess_init=0.3)
    state = opt.init({"x": jnp.ones(3)})
    grads, noises = {"x": jnp.array([1.0, 1e18, 1.0])}, {"x": jnp.array([0.1, 1e18, 0.1])}
    new, info = jax.jit(lambda s: opt.update(s, price_from_samples(s, grads, noises, 50.0)))(state)
    assert np.all(np.isfinite(new.mean)) and np.all(np.isfinite(new.precision)) and np.all(np.isfinite(new.momentum))
    assert new.mean[1] == state.mean[1] and new.precision[1] == state.precision[1]
    assert new.mean[0] != state.mean[0] and new.precision[0] != state.precision[0]


@pytest.mark.parametrize("row", ["ivon", "lie_affine"])
def test_accelerator_layout_bf16_params(row, fused):
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), PARAMS)
    algo = ROWS[row]()
    state = algo.init(params)
    state, info = jax.jit(lambda s: algo.step(jax.random.key(0), s, loss_fn, X.astype(jnp.bfloat16), Y))(state)
    assert not bool(info.skipped)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(state.params))

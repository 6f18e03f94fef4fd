"""The network rows' padded flat state (tree.FlatLayout with ``padded=True``).

On a CPU with several threads XLA cuts every large elementwise loop into one part per thread, and a loop whose length
is not a multiple of the number of parts masks every vector load and store: before the padding, an odd number of
weights made IVON's step about 1.5x slower on two threads than an even number, and the affine rule's 1.3-1.5x
(docs/deep-learning.md, "Padded flat states"; bench/bench_liegroup.py). From ``tree.PAD_FROM`` weights on, the rows'
states are padded to a multiple of ``tree.PAD_MULTIPLE``. These tests check that the padding changes nothing but the
shapes: the same step from the same draw and gradient, draws with the state's moments, priors and optax views that
accept the padded vectors. They lower ``PAD_FROM`` and ``PAD_MULTIPLE`` (``_pad_small``) so that a small network is
padded; the times are the bench's.
"""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
import optax
import pytest

import numpyro_blr as nb
import numpyro_blr.tree as tree
from numpyro_blr.tree import FlatLayout, padded_length

# 81 weights: padded to 96 by _pad_small
PARAMS = {"w1": np.random.default_rng(0).standard_normal((5, 9)).astype(np.float32) * 0.3,
          "b1": np.zeros(9, np.float32), "w2": np.random.default_rng(1).standard_normal((9, 3)).astype(np.float32) * 0.3}
N_WEIGHTS = 81
X = jnp.asarray(np.random.default_rng(2).standard_normal((16, 5)), jnp.float32)
Y = jnp.asarray(np.random.default_rng(3).integers(0, 3, 16), jnp.int32)


def loss_fn(params, x, y):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return optax.softmax_cross_entropy_with_integer_labels(h @ params["w2"], y).mean()


def _pad_small(monkeypatch, on=True):
    monkeypatch.setattr(tree, "PAD_FROM", 16 if on else 10**12)
    monkeypatch.setattr(tree, "PAD_MULTIPLE", 48)


def test_padded_length_depends_on_the_count_alone():
    assert padded_length(tree.PAD_FROM - 1) == tree.PAD_FROM - 1  # small networks: no padding
    for n in (tree.PAD_FROM, 1_862_665, 1_863_690, 50_200_001):
        m = padded_length(n)
        assert n <= m < n + tree.PAD_MULTIPLE
        for threads in (2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 64, 128, 256):
            assert m % threads == 0, (n, threads)


def test_layout_pads_and_reads_back_the_weights(monkeypatch):
    _pad_small(monkeypatch)
    layout = FlatLayout.of(PARAMS, padded=True)
    assert (layout.size, layout.pad, layout.length) == (N_WEIGHTS, 15, 96)
    assert FlatLayout.of(PARAMS).pad == 0  # unpadded unless asked (a guide's sites, uniform_like)
    flat = jax.jit(lambda p: layout.ravel(p, fill=2.0))(PARAMS)
    assert flat.shape == (96,)
    np.testing.assert_array_equal(np.asarray(flat[N_WEIGHTS:]), 2.0)
    for k, v in layout.unravel(flat).items():
        np.testing.assert_array_equal(np.asarray(v), PARAMS[k])
    batched = layout.ravel_batched(jax.tree.map(lambda v: jnp.stack([v, 2 * v]), PARAMS))
    assert batched.shape == (2, 96)
    np.testing.assert_array_equal(np.asarray(batched[:, N_WEIGHTS:]), 0.0)


ROWS = {
    "ivon": lambda: nb.ivon(lr=0.05, ess=200.0, hess_init=0.5, weight_decay=1e-3),
    "vogn": lambda: nb.vogn(lr=0.05, ess=200.0),
    "bsam": lambda: nb.bsam(lr=0.05, ess=200.0),
    "adam_blr": lambda: nb.adam_blr(0.01),
    "sgd_blr": lambda: nb.sgd_blr(0.05, momentum=0.9),
    "lie_additive": lambda: nb.lie_additive(0.05, momentum=0.9, base=dist.Normal(0.0, 0.05)),
    "lie_gradient_descent": lambda: nb.lie_additive(0.05, momentum=0.9),  # a Dirac q0: no noise
    "lie_affine": lambda: nb.lie_affine(0.05, ess=200.0, weight_decay=1e-3),
    "lie_multiplicative": lambda: nb.lie_multiplicative(0.05, ess=200.0),
}
NOISE_FREE = ("adam_blr", "sgd_blr", "lie_gradient_descent")


def _run(row, steps=5):
    algo = ROWS[row]()
    state = algo.init(PARAMS)
    step = jax.jit(lambda k, s: algo.step(k, s, loss_fn, X, Y))
    for i in range(steps):
        state, info = step(jax.random.key(i), state)
        assert not bool(info.skipped)
    return state


def _weights(state):
    return [np.asarray(x) for x in jax.tree.leaves(state.params)]


QUICK_ROWS = ("ivon", "adam_blr", "lie_affine")  # the quick subset's (make test-fast); every row in make test


@pytest.mark.parametrize("layout", ["cpu", pytest.param("accelerator", marks=pytest.mark.slow)])
@pytest.mark.parametrize("row", [r if r in QUICK_ROWS else pytest.param(r, marks=pytest.mark.slow) for r in sorted(ROWS)])
def test_padded_steps_are_finite_and_leave_the_padding(row, layout, monkeypatch):
    """The steps of a padded state, in the CPU's layout and in the accelerator's (tree.fused_passes: the noise
    recomputed where it is read, the skip decided before the update), checked here on the CPU."""
    monkeypatch.setattr(tree, "fused_passes", lambda: layout == "accelerator")
    _pad_small(monkeypatch, on=False)
    plain = _run(row)
    _pad_small(monkeypatch)
    padded = _run(row)
    assert plain.layout.pad == 0 and padded.layout.pad == (0 if row == "lie_multiplicative" else 15)
    for leaf in jax.tree.leaves(padded):
        assert np.isfinite(np.asarray(leaf)).all()
    if row in NOISE_FREE:  # the same operations on the same weights (XLA may fuse them differently: a rounding apart)
        for a, b in zip(_weights(plain), _weights(padded)):
            np.testing.assert_allclose(a, b, rtol=2e-6, atol=2e-7)
    if row == "lie_multiplicative":  # not padded (init_multiplicative: slower on one thread), so the same steps
        for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(padded)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        return
    if row == "lie_affine":  # its weight decay acts on the padding's draws theta = b + A eps (as on any weight
        return               # without a data gradient): they move, finite, and no loss reads them
    for f in ("mean", "loc", "momentum"):  # no gradient reaches the padding: these stay where they started
        v = getattr(padded, f, None)
        if v is not None and v.shape[0] == 96:
            np.testing.assert_array_equal(np.asarray(v)[N_WEIGHTS:], np.asarray(v)[N_WEIGHTS])


def _padded_vector(v):
    """A flat vector of the unpadded layout padded by zeros to 96."""
    return jnp.pad(v, (0, 96 - N_WEIGHTS))


@pytest.mark.parametrize("row", ["ivon", "vogn", "lie_additive", "lie_affine"])
def test_padded_update_from_the_same_draw_is_the_unpadded_update(row, monkeypatch):
    """The sampled rows' update (their optax view's: the estimate formed from a gradient and the draw's noise) gives
    the weights the same step with the padding as without, for the same draw and gradient."""
    rng = np.random.default_rng(5)
    g = jnp.asarray(rng.standard_normal(N_WEIGHTS), jnp.float32)
    noise = jnp.asarray(rng.standard_normal(N_WEIGHTS), jnp.float32) * 0.1
    extra = {"squared_grads": jax.tree.map(lambda x: jnp.ones_like(x) * 0.3, PARAMS)} if row == "vogn" else {}
    out = []
    for on in (False, True):
        _pad_small(monkeypatch, on)
        algo = ROWS[row]()
        state = algo.init(PARAMS)
        gg = _padded_vector(g) if on else g
        nn = _padded_vector(noise) if on else noise
        for _ in range(3):
            state, info = algo.update(state, algo.parts.estimator.from_grads(state, gg, nn, **extra))
            assert not bool(info.skipped)
        out.append(_weights(state))
    for a, b in zip(*out):
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=2e-7)


@pytest.mark.parametrize("row", ["ivon", pytest.param("lie_affine", marks=pytest.mark.slow)])
def test_padded_draws_have_the_states_mean_and_scale(row, monkeypatch):
    """The weights drawn from a padded state (``sample``) have the state's mean and standard deviation, weight by
    weight: the noise is read at the weights' own entries. Bounds: 5 standard errors of S = 4,000 draws."""
    _pad_small(monkeypatch)
    algo = ROWS[row]()
    state = _run(row)
    draws = algo.sample(jax.random.key(7), state, 4000)
    flat = np.concatenate([np.asarray(x).reshape(4000, -1) for x in jax.tree.leaves(draws)], axis=1)
    if row == "ivon":
        mean, sd = np.asarray(state.mean)[:N_WEIGHTS], 1.0 / np.sqrt(200.0 * np.asarray(state.precision)[:N_WEIGHTS])
    else:  # Normal(0, 1) q0: theta = b + A eps
        mean, sd = np.asarray(state.loc)[:N_WEIGHTS], np.asarray(state.scale)[:N_WEIGHTS]
    assert flat.shape == (4000, N_WEIGHTS)
    assert np.all(np.abs(flat.mean(0) - mean) < 5 * sd / np.sqrt(4000))
    assert np.all(np.abs(flat.std(0) / sd - 1) < 5 / np.sqrt(2 * 4000))


@pytest.mark.slow
def test_optax_view_and_priors_take_the_padded_state(monkeypatch):
    _pad_small(monkeypatch)
    algo = nb.ivon(lr=0.05, ess=200.0, hess_init=0.5)
    tx = nb.as_optax(algo)
    opt_state = tx.init(PARAMS)
    assert opt_state.precision.shape == (96,)
    theta = nb.perturbed(algo, PARAMS, opt_state)
    updates, opt_state = tx.update(jax.grad(loss_fn)(theta, X, Y), opt_state, PARAMS)
    assert jax.tree.map(jnp.shape, updates) == jax.tree.map(jnp.shape, PARAMS)
    assert all(np.isfinite(np.asarray(u)).all() for u in jax.tree.leaves(updates))

    state = _run("ivon")
    for prior in (state.as_prior(ess=200.0),  # the padded flat vectors
                  nb.rules.diagonal.DiagonalPrior(np.asarray(state.mean)[:N_WEIGHTS], np.asarray(state.precision)[:N_WEIGHTS]),
                  nb.rules.diagonal.DiagonalPrior(state.params, state.tree(state.precision))):
        nxt = algo.init(PARAMS, prior=prior)
        np.testing.assert_allclose(np.asarray(nxt.prior.mean)[:N_WEIGHTS], np.asarray(state.mean)[:N_WEIGHTS], rtol=1e-6)
        np.testing.assert_allclose(np.asarray(nxt.precision)[:N_WEIGHTS], np.asarray(state.precision)[:N_WEIGHTS],
                                   rtol=1e-6)
        assert (np.asarray(nxt.precision) > 0).all() and nxt.precision.shape == (96,)
    with pytest.raises(ValueError, match="flat vector of 96 .* or 81"):
        algo.init(PARAMS, prior=nb.rules.diagonal.DiagonalPrior(np.zeros(50, np.float32), 1.0))


@pytest.mark.slow
def test_a_state_without_the_padding_is_a_prior_for_the_padded_layout(monkeypatch):
    """A state built before the padding (or with another padding) gives its posterior to a padded state."""
    _pad_small(monkeypatch, on=False)
    old = _run("ivon")
    _pad_small(monkeypatch)
    algo = ROWS["ivon"]()
    nxt = algo.init(PARAMS, prior=old)
    assert nxt.layout.pad == 15 and nxt.precision.shape == (96,)
    np.testing.assert_allclose(np.asarray(nxt.prior.mean)[:N_WEIGHTS], np.asarray(old.mean), rtol=1e-6)
    assert (np.asarray(nxt.prior.precision) > 0).all()

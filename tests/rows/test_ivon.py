"""IVON (Shen et al. 2024) checked against the published equations, written out in numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from numpyro_blr.deep import DiagonalState, ivon, predictive, price_from_samples
from numpyro_blr.rules.blr import diagonal_precision_update

SHAPES = {"w": (2, 3), "b": (3,)}


def _tree(rng, scale=1.0):
    return {k: (scale * rng.standard_normal(s)).astype(np.float32) for k, s in SHAPES.items()}


def _update(opt, grads, noises, state, ess=None, hess_approx="price"):
    """The rule alone on the Price statistics of gradients ``grads`` at ``mean + noises`` (IVON's update)."""
    ess = HYPER["ess"] if ess is None else ess
    return opt.update(state, price_from_samples(state, grads, noises, ess, hess_approx))[0]


def _hess(state, delta):
    """IVON's h: the state's per-example precision minus the weight decay, as the weights' pytree."""
    return state.tree(state.precision - delta)


def hessian_update(h, h_hat, beta2, delta):
    """IVON's h step (Shen et al. 2024, Algorithm 1, line 6), through the one diagonal precision step:
    p = h + delta takes the improved-BLR step towards h_hat + delta with rho = 1 - beta2."""
    return diagonal_precision_update(h + delta, h_hat + delta, 1.0 - beta2, "improved") - delta


def _numpy_ivon(m, h, mom, grads, noises, t, *, lr, ess, delta, b1, b2, hess_init, clip=np.inf, gradsq=False):
    """One IVON step (Algorithm 1 of Shen et al. 2024), plain numpy float64, one leaf."""
    g = np.mean(grads, axis=0)
    if gradsq:
        h_hat = ess * np.mean(np.square(grads), axis=0)
    else:
        h_hat = ess * (h + delta) * np.mean(noises * grads, axis=0)
    mom = b1 * mom + (1 - b1) * g
    h = b2 * h + (1 - b2) * h_hat + 0.5 * (1 - b2) ** 2 * (h - h_hat) ** 2 / (h + delta)
    step = (mom / (1 - b1**t) + delta * m) / (h + delta)
    m = m - lr * (hess_init + delta) * np.clip(step, -clip, clip)
    return m, h, mom


HYPER = dict(lr=0.05, ess=50.0, hess_init=0.3, beta1=0.9, beta2=0.9, weight_decay=1e-2)


@pytest.mark.parametrize("hess_approx", ["price", "gradsq"])
@pytest.mark.parametrize("form", ["list", "stacked"])
def test_several_steps_match_hand_equations(hess_approx, form):
    rng = np.random.default_rng(0)
    opt = ivon(**HYPER, hess_approx=hess_approx, clip_radius=3.0)
    update = jax.jit(lambda g, n, s: _update(opt, g, n, s, hess_approx=hess_approx))
    m0 = _tree(rng)
    state = opt.init(m0)
    ref = {k: (m0[k].astype(np.float64), np.full(s, HYPER["hess_init"]), np.zeros(s)) for k, s in SHAPES.items()}
    S = 2
    for t in range(1, 5):
        grads = [_tree(rng, 3.0) for _ in range(S)]
        noises = [_tree(rng, 0.5) for _ in range(S)]
        if form == "list":
            state = update(grads, noises, state)
        else:
            stack = lambda xs: jax.tree.map(lambda *a: jnp.stack(a), *xs)
            state = update(stack(grads), stack(noises), state)
        for k in SHAPES:
            G = np.stack([g[k] for g in grads]).astype(np.float64)
            N = np.stack([n[k] for n in noises]).astype(np.float64)
            ref[k] = _numpy_ivon(
                *ref[k], G, N, t, lr=HYPER["lr"], ess=HYPER["ess"], delta=HYPER["weight_decay"],
                b1=HYPER["beta1"], b2=HYPER["beta2"], hess_init=HYPER["hess_init"], clip=3.0,
                gradsq=hess_approx == "gradsq",
            )
            np.testing.assert_allclose(state.params[k], ref[k][0], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(_hess(state, HYPER["weight_decay"])[k], ref[k][1], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(state.tree(state.momentum)[k], ref[k][2], rtol=1e-5, atol=1e-6)
        assert int(state.count) == t and int(state.skipped) == 0


def test_one_step_numbers_by_hand():
    # scalar parameter, one MC sample, written out: m=1, h=0.5, delta=0.1, ess=10, lr=0.2
    # noise=0.3, grad=2: h_hat = 10*0.6*0.6 = 3.6; mom = 0.1*2 = 0.2;
    # h = 0.5*0.5 + 0.5*3.6 + 0.5*0.25*(0.5-3.6)^2/0.6 = 0.25 + 1.8 + 1.20125/0.6 = 4.0520833...
    # m = 1 - 0.2*(0.5+0.1)*((0.2/0.1 + 0.1*1)/(4.0520833+0.1)) = 1 - 0.12*2.1/4.1520833...
    opt = ivon(lr=0.2, ess=10.0, hess_init=0.5, beta1=0.9, beta2=0.5, weight_decay=0.1)
    state = _update(opt, {"x": jnp.array(2.0)}, {"x": jnp.array(0.3)}, opt.init({"x": jnp.array(1.0)}), ess=10.0)
    np.testing.assert_allclose(_hess(state, 0.1)["x"], 0.25 + 1.8 + 1.20125 / 0.6, rtol=1e-6)
    np.testing.assert_allclose(state.tree(state.momentum)["x"], 0.2, rtol=1e-6)
    np.testing.assert_allclose(state.params["x"], 1 - 0.12 * 2.1 / (0.25 + 1.8 + 1.20125 / 0.6 + 0.1), rtol=1e-6)


@pytest.mark.slow
def test_sample_scale_and_rescale_lr_off():
    opt = ivon(lr=0.1, ess=100.0, hess_init=3.0, weight_decay=1.0)
    state = opt.init({"a": jnp.zeros(20000)})
    theta = opt.sample(jax.random.key(0), state, 1)
    noise = {"a": theta["a"][0] - state.params["a"]}
    np.testing.assert_array_equal(theta["a"][0], noise["a"])
    # std must be 1/sqrt(100*(3+1)) = 0.05; sample std of 20000 normals has rel. s.e. 1/sqrt(40000) = 0.5%
    np.testing.assert_allclose(np.std(noise["a"]), 0.05, rtol=0.03)
    # rescale_lr=False: first step with zero noise is m - lr*(g/(h+delta) + ...); no hess_init factor
    opt2 = ivon(lr=0.1, ess=100.0, hess_init=3.0, weight_decay=1.0, beta2=0.5, rescale_lr=False)
    s = _update(opt2, {"a": jnp.array(4.0)}, {"a": jnp.array(0.0)}, opt2.init({"a": jnp.array(0.0)}), ess=100.0)
    h = 0.5 * 3.0 + 0.0 + 0.5 * 0.25 * 9.0 / 4.0
    np.testing.assert_allclose(s.params["a"], -0.1 * 4.0 / (h + 1.0), rtol=1e-6)


def test_step_equals_sample_grad_update_and_jits():
    loss = lambda p, x, y: jnp.mean((x @ p["w"] + p["b"] - y) ** 2)
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((8, 2)).astype(np.float32), rng.standard_normal((8, 3)).astype(np.float32)
    opt = ivon(lr=0.1, ess=8.0, mc_samples=2)
    state = opt.init(_tree(rng))
    key = jax.random.key(3)

    @jax.jit
    def manual_step(key, state):
        draws = opt.sample(key, state, 2)  # draw s with jax.random.split(key, 2)[s], as step's samples
        thetas = [jax.tree.map(lambda a: a[i], draws) for i in range(2)]
        grads = [jax.grad(loss)(th, x, y) for th in thetas]
        noises = [jax.tree.map(jnp.subtract, th, state.params) for th in thetas]
        mean_loss = sum(loss(th, x, y) for th in thetas) / 2
        return _update(opt, grads, noises, state, ess=8.0), mean_loss

    manual, manual_loss = manual_step(key, state)
    for vmap_samples in (True, False):  # vmap over the MC samples, or a scan accumulating the means
        o = ivon(lr=0.1, ess=8.0, mc_samples=2, vmap_samples=vmap_samples)
        new, info = jax.jit(lambda k, s: o.step(k, s, loss, x, y))(key, state)
        l = info.loss
        for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(manual)):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)
        np.testing.assert_allclose(l, manual_loss, rtol=1e-5)


def test_axis_name_pmean_equals_pooled_samples():
    # two devices, each with half of the data and its own weight draw (the key folded with the device
    # index): the statistics are averaged once, so both devices take the step that pools the two
    # draws' gradients of the two halves' losses
    from numpyro_blr.estimators.weights import price

    rng = np.random.default_rng(2)
    loss = lambda p, x: jnp.mean(jnp.sum((x[:, :2, None] * p["w"]).sum(1) + p["b"] - x[:, 2:], axis=-1) ** 2)
    data = jnp.asarray(rng.standard_normal((2, 4, 5)), jnp.float32)  # (devices, examples, features)
    dist = ivon(**HYPER, axis_name="dev")
    state = dist.init(_tree(rng))
    pooled_opt = ivon(**HYPER)
    key = jax.random.key(7)

    @jax.jit
    def both(state):
        out, info = jax.vmap(lambda x: dist.step(key, state, loss, x), axis_name="dev")(data)
        ests = [price(HYPER["ess"])(jax.random.fold_in(key, d), state, loss, data[d]) for d in range(2)]
        mean = jax.tree.map(lambda a, b: (a + b) / 2, *ests)
        return out, info, pooled_opt.update(state, mean)[0], mean.loss

    out, info, pooled, pooled_loss = both(state)
    for a, b in zip(jax.tree.leaves(pooled), jax.tree.leaves(out)):
        np.testing.assert_allclose(b[0], a, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(b[1], a, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(info.loss, [pooled_loss, pooled_loss], rtol=1e-6)


@settings(max_examples=300, deadline=None)
@given(
    h=st.floats(0.0, 1e6),
    h_hat=st.floats(-1e8, 1e8),
    beta2=st.floats(0.0, 0.999999),
    delta=st.floats(1e-8, 10.0),
)
def test_positivity_for_adversarial_hessian(h, h_hat, beta2, delta):
    # P_new = P (1 + x + x^2/2) with x = (1-b2)(h_hat-h)/P, and 1 + x + x^2/2 >= 1/2 for all real x.
    new = hessian_update(np.float64(h), np.float64(h_hat), beta2, delta)  # plain float64 arithmetic
    assert new + delta >= 0.5 * (h + delta) * (1 - 1e-12)


_POS_OPT = ivon(lr=0.1, ess=3.0, hess_init=1.0, beta2=0.5, weight_decay=1e-3)
_POS_UPDATE = jax.jit(lambda g, n, s: _POS_OPT.update(s, price_from_samples(s, g, n, 3.0)))


@settings(max_examples=40, deadline=None)
@given(
    h=st.lists(st.floats(0.0, 1e3, width=32), min_size=16, max_size=16),
    h_hat=st.lists(st.floats(-1e6, 1e6, width=32), min_size=16, max_size=16),
)
def test_positivity_through_update_float32(h, h_hat):
    # noise = 1 and grad = h_hat / (ess (h + delta)) make the Price estimate equal to h_hat
    h, h_hat, P = np.float32(h), np.float32(h_hat), np.float32(h) + np.float32(1e-3)
    st0 = _POS_OPT.init({"a": jnp.zeros(16)})._replace(precision=jnp.asarray(P))
    st1, info = _POS_UPDATE({"a": jnp.asarray(h_hat / (3.0 * P))}, {"a": jnp.ones(16)}, st0)
    assert not bool(info.skipped)
    # float32 rounding of the three terms: allow a relative 1e-5 slack
    assert np.all(np.asarray(_hess(st1, 1e-3)["a"]) + 1e-3 >= 0.5 * P * (1 - 1e-5))


@pytest.mark.slow
def test_quadratic_hessian_and_variance_converge():
    # loss per example: 0.5 * sum a_i (theta_i - c_i)^2; ess = N; prior precision N*delta.
    # Exact posterior: precision N (a + delta), mean a c / (a + delta).
    d, N, delta, b2, T = 256, 1000.0, 1e-3, 0.999, 8000
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.uniform(0.5, 3.0, d), jnp.float32)
    c = jnp.asarray(rng.standard_normal(d), jnp.float32)
    loss = lambda p: 0.5 * jnp.sum(a * (p - c) ** 2)
    opt = ivon(lr=0.05, ess=N, hess_init=1.0, beta2=b2, weight_decay=delta)

    def body(s, k):
        return opt.step(k, s, loss)[0], None

    state, _ = jax.jit(lambda s, ks: jax.lax.scan(body, s, ks))(opt.init(jnp.zeros(d)), jax.random.split(jax.random.key(0), T))
    ratio = np.asarray(_hess(state, delta)) / np.asarray(a)
    # The Price estimate here is h_hat = a * z^2, z ~ N(0,1): mean a, variance 2 a^2. The EMA with
    # weight 1-b2 has stationary relative s.d. sqrt((1-b2)/(1+b2) * 2) = 0.032 per coordinate, a bias
    # of about (1-b2) = 0.001 from the improved-BLR term and a transient exp(-T(1-b2)) < 4e-4.
    # Per coordinate: 7 s.d. = 0.22 (256 coordinates). Mean over 256 independent coordinates:
    # s.d. 0.032/16 = 0.002, so 0.012 is ~5 s.d. plus the bias.
    assert np.max(np.abs(ratio - 1)) < 0.22
    assert abs(np.mean(ratio) - 1) < 0.012
    # posterior variance of the samples vs the exact 1/(N(a+delta)): 4000 draws give a relative s.e.
    # of sqrt(2/4000) = 0.022 per coordinate, 0.0014 for the mean over 256 coordinates; add the h error.
    noises = opt.sample(jax.random.key(1), state, 4000) - state.params
    var_ratio = np.var(np.asarray(noises), axis=0) * N * (np.asarray(a) + delta)
    assert abs(np.mean(var_ratio) - 1) < 0.02
    assert np.max(np.abs(var_ratio - 1)) < 0.35
    # mean: within 5 posterior s.d. of the exact posterior mean (it jitters with the gradient noise)
    post_mean = a * c / (a + delta)
    post_sd = 1 / np.sqrt(N * (np.asarray(a) + delta))
    assert np.max(np.abs(np.asarray(state.params) - post_mean) / post_sd) < 5


def test_nonfinite_step_is_skipped():
    opt = ivon(**HYPER)
    state = opt.init({"x": jnp.ones(3)})
    update = lambda g, n, s: opt.update(s, price_from_samples(s, g, n, HYPER["ess"]))
    good, _ = update({"x": jnp.ones(3)}, {"x": 0.1 * jnp.ones(3)}, state)
    bad, info = update({"x": jnp.array([1.0, jnp.nan, 1.0])}, {"x": 0.1 * jnp.ones(3)}, good)
    assert bool(info.skipped) and int(bad.skipped) == 1 and int(bad.count) == 1
    for a, b in zip((good.mean, good.precision, good.momentum), (bad.mean, bad.precision, bad.momentum)):
        np.testing.assert_array_equal(a, b)
    inf, info = update({"x": jnp.full(3, 1e30)}, {"x": jnp.full(3, 1e30)}, bad)  # overflowing Hessian
    assert bool(info.skipped) and int(inf.skipped) == 2 and np.all(np.isfinite(inf.precision))
    again, info = update({"x": jnp.ones(3)}, {"x": 0.1 * jnp.ones(3)}, inf)
    assert not bool(info.skipped) and int(again.count) == 2 and int(again.skipped) == 2


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lr=0.1), "ess"),
        (dict(lr=0.1, ess=0.0), "ess"),
        (dict(lr=0.1, ess="many"), "ess"),
        (dict(lr=-0.1, ess=10.0), "lr"),
        (dict(lr=0.1, ess=10.0, weight_decay=-1e-4), "weight_decay"),
        (dict(lr=0.1, ess=10.0, beta1=1.0), "beta1"),
        (dict(lr=0.1, ess=10.0, beta2=-0.1), "beta2"),
        (dict(lr=0.1, ess=10.0, hess_init=0.0), "hess_init"),
        (dict(lr=0.1, ess=10.0, mc_samples=0), "mc_samples"),
        (dict(lr=0.1, ess=10.0, hess_approx="fisher"), "hess_approx"),
        (dict(lr=0.1, ess=10.0, clip_radius=0.0), "clip_radius"),
        (dict(lr=0.1, ess=10.0, state_dtype=jnp.float16), "state_dtype=float16"),
        (dict(lr=0.1, ess=10.0, state_dtype=jnp.bfloat16), "state_dtype=bfloat16"),
        (dict(lr=0.1, ess=10.0, state_dtype=jnp.int32), "state_dtype"),
    ],
)
def test_bad_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ivon(**kwargs)


def test_bad_params_and_inputs():
    opt = ivon(lr=0.1, ess=10.0)
    with pytest.raises(ValueError, match="mixes dtypes"):
        opt.init({"a": jnp.zeros(2, jnp.float32), "b": jnp.zeros(2, jnp.bfloat16)})
    with pytest.raises(ValueError, match="non-floating"):
        opt.init({"a": jnp.zeros(2, jnp.int32)})
    state = opt.init({"a": jnp.zeros(2)})
    with pytest.raises(ValueError, match="grads"):
        price_from_samples(state, {"b": jnp.zeros(2)}, {"a": jnp.zeros(2)}, 10.0)


def test_predictive_averages_probabilities():
    opt = ivon(lr=0.1, ess=4.0, hess_init=1.0)
    state = opt.init({"w": jnp.zeros((3, 2))})
    apply = lambda p, x: jax.nn.softmax(x @ p["w"])
    x = jnp.ones((5, 3))
    out = predictive(jax.random.key(0), state, apply, x, 4, sample=opt.sample)
    draws = opt.sample(jax.random.key(0), state, 4)
    manual = jax.jit(lambda s: sum(apply(jax.tree.map(lambda a: a[i], draws), x) for i in range(4)) / 4)(state)
    np.testing.assert_allclose(out, manual, rtol=1e-5)
    np.testing.assert_allclose(np.sum(out, -1), 1.0, rtol=1e-5)


# ----------------------------------------------------------------------------- the weight-noise generator


def test_hash_normal_is_standard_normal_and_independent():
    from scipy import stats

    from numpyro_blr.tree import hash_normal

    n = 400_000
    key = jax.random.key(7)
    z = np.asarray(jax.jit(lambda k: hash_normal(k, n))(key), np.float64)
    assert z.shape == (n,) and np.all(np.isfinite(z)) and np.max(np.abs(z)) < 5.8
    # moments, in units of their standard errors under N(0, 1): 5 s.e. bounds
    assert abs(z.mean()) * np.sqrt(n) < 5
    assert abs(z.var() - 1) / np.sqrt(2 / n) < 5
    assert abs(stats.skew(z)) / np.sqrt(6 / n) < 5
    assert abs(stats.kurtosis(z)) / np.sqrt(24 / n) < 5
    assert stats.kstest(z, "norm").pvalue > 1e-4
    # independence: neighbours, the two outputs of one Box-Muller pair (elements j and j + n/2; also
    # their squares, which share the radius) and draws from consecutive fold_in keys (one per step)
    half = n // 2
    z2 = np.asarray(hash_normal(jax.random.fold_in(key, 1), n), np.float64)
    for a, b in [(z[:-1], z[1:]), (z[:half], z[half:]), (z[:half] ** 2, z[half:] ** 2), (z, z2), (z**2, z2**2)]:
        assert abs(np.corrcoef(a, b)[0, 1]) * np.sqrt(len(a)) < 5

    # 2-d uniformity of the pair partners: chi-square over a 10 x 10 grid of normal quantiles
    cells = [np.digitize(stats.norm.cdf(v), np.linspace(0, 1, 11)[1:-1]) for v in (z[:half], z[half:])]
    counts = np.bincount(cells[0] * 10 + cells[1], minlength=100)
    assert stats.chisquare(counts).pvalue > 1e-4


def test_hash_streams_of_keys_that_differ_in_low_bits_are_independent():
    """The counter hash's keys pick an arithmetic progression of counters (odd stride): key words that
    differ only in their low bits (which XOR-ing the counter with the key would map to the same set of
    counters, permuted) still give uncorrelated draws, element by element and in distribution."""
    from scipy import stats

    from numpyro_blr.tree import _box_muller_pairs, hash_uniform_at

    n = 200_000
    j = jnp.arange(n, dtype=jnp.uint32)
    k = np.array([0x9E3779B9, 0x7F4A7C15, 0x94D049BB, 0x2545F491], np.uint32)
    for flip in (1, 2, 1 << 10):
        k2 = k ^ np.uint32(flip)
        (r1, b1), (r2, b2) = _box_muller_pairs(jnp.asarray(k), j), _box_muller_pairs(jnp.asarray(k2), j)
        r1, r2 = np.asarray(r1, np.float64), np.asarray(r2, np.float64)
        assert abs(np.corrcoef(r1, r2)[0, 1]) * np.sqrt(n) < 5
        phi1, phi2 = (np.asarray(b, np.float64) / 2**32 for b in (b1, b2))
        assert abs(np.corrcoef(phi1, phi2)[0, 1]) * np.sqrt(n) < 5
        # not a permutation of the same values: the sorted draws differ almost everywhere
        assert np.mean(np.sort(r1) == np.sort(r2)) < 0.01
        u1 = np.asarray(hash_uniform_at(jnp.asarray(k[:2]), 0, n), np.float64)
        u2 = np.asarray(hash_uniform_at(jnp.asarray(k2[:2]), 0, n), np.float64)
        assert abs(np.corrcoef(u1, u2)[0, 1]) * np.sqrt(n) < 5
        assert np.mean(np.sort(u1) == np.sort(u2)) < 0.01


def test_hash_uniform_is_uniform_and_independent():
    from scipy import stats

    from numpyro_blr.tree import hash_uniform

    n = 400_000
    key = jax.random.key(11)
    u = np.asarray(jax.jit(lambda k: hash_uniform(k, n))(key), np.float64)
    assert u.shape == (n,) and np.all((u > 0) & (u < 1))
    assert stats.kstest(u, "uniform").pvalue > 1e-4
    u2 = np.asarray(hash_uniform(jax.random.fold_in(key, 1), n), np.float64)
    for a, b in [(u[:-1], u[1:]), (u[:-2], u[2:]), (u, u2)]:
        assert abs(np.corrcoef(a, b)[0, 1]) * np.sqrt(len(a)) < 5
    # 2-d uniformity of neighbours: chi-square over a 10 x 10 grid
    cells = np.minimum((u * 10).astype(int), 9)
    counts = np.bincount(cells[:-1:2] * 10 + cells[1::2], minlength=100)
    assert stats.chisquare(counts).pvalue > 1e-4


@pytest.mark.slow
def test_hash_normal_small_draws_across_keys_and_dtypes():
    from scipy import stats

    from numpyro_blr.tree import hash_normal

    # the typical use: a fresh fold_in key per step; element 0 (and 2) over 100k steps must be N(0, 1)
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(3), i))(jnp.arange(100_000))
    draws = np.asarray(jax.jit(jax.vmap(lambda k: hash_normal(k, 3)))(keys), np.float64)
    for col in (0, 2):
        assert stats.kstest(draws[:, col], "norm").pvalue > 1e-4
    assert abs(np.corrcoef(draws[:, 0], draws[:, 1])[0, 1]) * np.sqrt(len(draws)) < 5
    # deterministic in the key, odd sizes, low-precision dtypes stay finite
    np.testing.assert_array_equal(hash_normal(keys[0], 5), hash_normal(keys[0], 5))
    assert not np.array_equal(hash_normal(keys[0], 5), hash_normal(keys[1], 5))
    for dt in (jnp.bfloat16, jnp.float16):
        zz = hash_normal(keys[0], 1001, dt)
        assert zz.dtype == dt and zz.shape == (1001,) and bool(jnp.all(jnp.isfinite(zz)))


@pytest.mark.slow
def test_noise_rng_options():
    params = {"w": jnp.zeros((30, 20)), "b": jnp.zeros(7)}
    key = jax.random.key(5)
    # 'jax' draws exactly jax.random.normal over the flattened parameters (the previous behaviour);
    # s.d. 1/sqrt(100 (3 + 1)) = 0.05
    opt = ivon(lr=0.1, ess=100.0, hess_init=3.0, weight_decay=1.0, noise_rng="jax")
    state = opt.init(params)
    noise = jax.tree.map(lambda a, m: a[0] - m, opt.sample(key, state, 1), state.params)
    flat = jax.random.normal(jax.random.split(key, 1)[0], (607,))
    np.testing.assert_allclose(jnp.concatenate([noise["b"], noise["w"].ravel()]), 0.05 * flat, rtol=1e-6)
    # any key implementation works for either generator; the hash one samples with the right scale
    for rng in ("jax", "hash"):
        o = ivon(lr=0.1, ess=100.0, hess_init=3.0, weight_decay=1.0, noise_rng=rng)
        nz = o.sample(jax.random.key(0, impl="rbg"), o.init({"a": jnp.zeros(20000)}), 1)
        np.testing.assert_allclose(np.std(nz["a"]), 0.05, rtol=0.03)
    with pytest.raises(ValueError, match="noise_rng"):
        ivon(lr=0.1, ess=10.0, noise_rng="mt19937")


def test_ivon_state_stores_flat_vectors_and_gives_back_the_pytrees():
    """DiagonalState keeps m, p and the momentum as flat vectors; params / tree(...) are exact views,
    it is a NamedTuple (_replace), and it passes through jit and lax.scan with its static layout."""
    params = {"w": jnp.arange(6.0).reshape(2, 3), "b": (jnp.array([7.0]), jnp.zeros((0,)))}
    opt = ivon(lr=0.1, ess=10.0)
    state = opt.init(params)
    assert state.mean.shape == (7,) and state.precision.shape == (7,)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, b)
    assert jax.tree.structure(state.tree(state.precision)) == jax.tree.structure(params)
    new_p = jax.tree.map(lambda p: p + 2.0, params)
    st2 = state._replace(precision=state.layout.ravel(new_p), count=jnp.int32(3))
    np.testing.assert_array_equal(st2.tree(st2.precision)["w"], new_p["w"])
    assert int(st2.count) == 3 and np.all(st2.params["w"] == params["w"])
    with pytest.raises(ValueError, match="Got unexpected field names"):
        state._replace(hess=1.0)
    out = jax.jit(lambda s: s)(st2)
    assert isinstance(out, DiagonalState) and out.layout == st2.layout
    np.testing.assert_array_equal(out.precision, st2.precision)

    def loss(p, x):
        return jnp.sum((p["w"] - x) ** 2) + jnp.sum(p["b"][0] ** 2)

    def body(s, k):
        s, info = opt.step(k, s, loss, 1.0)
        return s, info.loss

    final, losses = jax.lax.scan(body, state, jax.random.split(jax.random.key(0), 5))
    assert int(final.count) == 5 and losses.shape == (5,) and "DiagonalState" in repr(final)


def test_low_precision_state_and_batch_errors_name_the_argument():
    from numpyro_blr import bsam, vogn
    from numpyro_blr.rules.diagonal import init_diagonal

    bf16 = {"w": jnp.ones((2, 3), jnp.bfloat16)}
    with pytest.raises(ValueError, match="state_dtype=float16 with bfloat16 parameters"):
        init_diagonal(bf16, 1.0, jnp.float16)
    with pytest.raises(ValueError, match="state_dtype=bfloat16 is narrower|state_dtype=bfloat16"):
        init_diagonal({"w": jnp.ones(3)}, 1.0, jnp.bfloat16)
    # a per-example batch whose arrays disagree on the example axis: named, with the shapes
    params = {"w": jnp.zeros(3)}
    opt = vogn(0.1, ess=10.0)
    per_example = lambda p, x, y: (x @ p["w"] - y) ** 2  # noqa: E731
    with pytest.raises(ValueError, match=r"batch arrays disagree.*0: \(5, 3\), 1: \(4,\)"):
        opt.step(jax.random.key(0), opt.init(params), per_example, jnp.ones((5, 3)), jnp.ones(4))
    with pytest.raises(ValueError, match="batch array 1 is a scalar"):
        opt.step(jax.random.key(0), opt.init(params), per_example, jnp.ones((5, 3)), 1.0)
    # bSAM's msharpness groups split the batch: it must divide the leading axis
    b = bsam(0.1, ess=10.0, msharpness=3)
    with pytest.raises(ValueError, match="msharpness=3"):
        b.step(jax.random.key(0), b.init(params), lambda p, x: jnp.mean(x @ p["w"]), jnp.ones((4, 3)))


def _smooth_problem(dtype):
    r"""A tanh network with a squared loss (smooth: no ReLU kinks whose flips would not be a precision effect), and the
    condition number of its residual :math:`\kappa = \sum_i(\sum_j|h_{ij}w_j| + |y_i|)/\sum_i|h_i^\top w - y_i|`
    at the start, by which rounding errors in the loss's terms are amplified in the gradient."""
    rng = np.random.default_rng(0)
    params = {"w1": 0.5 * rng.standard_normal((6, 8)), "b1": np.zeros(8), "w2": 0.5 * rng.standard_normal((8, 1))}
    x, y = rng.standard_normal((32, 6)), rng.standard_normal((32, 1))
    h = np.tanh(x @ params["w1"] + params["b1"])
    kappa = np.sum(np.abs(h) @ np.abs(params["w2"]) + np.abs(y)) / np.sum(np.abs(h @ params["w2"] - y))
    cast = lambda t: jax.tree.map(lambda a: jnp.asarray(a, dtype), t)  # noqa: E731

    def loss(p, x, y):
        h = jnp.tanh(x @ p["w1"] + p["b1"])
        return jnp.mean((h @ p["w2"] - y) ** 2)

    return cast(params), cast(x), cast(y), loss, float(kappa)


def agree_in_bf16(algo, arrays, steps=10):
    r"""Run ``algo`` ``steps`` steps from float32 and from bfloat16 parameters and inputs (same keys) and check that
    the bfloat16 run keeps a float32 state whose ``arrays(state)`` (location and scale arrays) agree with the float32
    run's within bfloat16's precision.

    Tolerance: with unit roundoff :math:`u = 2^{-9}`, the bfloat16 forward and backward pass (weights and inputs
    rounded, dot products of length 6-8, a tanh) gives gradients whose error is a few :math:`u` of the loss's terms,
    that is :math:`\le 8u\kappa` of the gradient (:math:`\kappa`: the residual's condition number, computed by
    :func:`_smooth_problem`); so each step's displacement of the state is off by at most :math:`8u\kappa` of itself
    and the final state by :math:`8u\kappa` times the float32 run's path length :math:`\sum_t\|\Delta_t\|`
    (Euclidean norms per array). A bfloat16 state instead loses every step smaller than :math:`u` of a weight
    (IVON's precision steps of :math:`1 - \beta_2 = 10^{-5}` entirely), and the dtype assertion fails first."""
    runs = {}
    for dt in (jnp.float32, jnp.bfloat16):
        params, x, y, loss, kappa = _smooth_problem(dt)
        state = algo.init(params)
        step = jax.jit(lambda k, s: algo.step(k, s, loss, x, y))
        path = [arrays(state)]
        for i in range(steps):
            state, info = step(jax.random.key(i), state)
            assert not bool(info.skipped)
            path.append(arrays(state))
        runs[dt] = (state, path)
    state16, path16 = runs[jnp.bfloat16]
    for leaf in jax.tree.leaves(state16):
        if jnp.issubdtype(leaf.dtype, jnp.floating) and leaf.size > 1:
            assert leaf.dtype == jnp.float32, "the bfloat16 run's state must be float32"
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(state16.params))
    _, path32 = runs[jnp.float32]
    u = 2.0**-9
    for k in range(len(path32[0])):
        ref = [np.asarray(p[k], np.float64) for p in path32]
        length = sum(np.linalg.norm(b - a) for a, b in zip(ref[:-1], ref[1:]))
        assert length > 0
        err = np.linalg.norm(np.asarray(path16[-1][k], np.float64) - ref[-1])
        assert err <= 8 * u * kappa * length, (k, err, 8 * u * kappa * length)


def test_bf16_params_float32_state_agree_with_float32():
    algo = ivon(0.05, ess=200.0, hess_init=0.5, weight_decay=1e-3)
    agree_in_bf16(algo, lambda s: (s.mean, s.precision))

"""The default step size's iterate averaging (``nb.adaptive_decay``, ``averaging=True``).

The Gaussian blocks step with rho = rho_0 / sqrt(1 + c/tau) on Kesten's clock c, and the guide that
``get_params`` returns is the exponential average of the iterates' means and scales (or Cholesky
factors) with weight gamma = rho_0 / (1 + c/tau) (Polyak-Ruppert averaging). Checked here: the
schedule's numbers and the weights they give the iterates, the recursion on the optimizer state,
that explicit step sizes keep no average, that a skipped step leaves the average alone, and (slow)
that on the centred eight-schools funnel the default reaches in 1,000 steps the Gaussian ELBO the
previous default had not reached after 4,000.
"""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from conftest import logistic_model
from numpyro.distributions import biject_to, constraints
from numpyro.infer import SVI, Trace_ELBO
from numpyro.infer.autoguide import AutoMultivariateNormal, AutoNormal

import numpyro_blr as nb


@pytest.fixture(scope="module")
def small_logistic():
    rng = np.random.default_rng(0)
    X = np.hstack([np.ones((60, 1)), rng.normal(size=(60, 2))])
    y = (rng.uniform(size=60) < 1 / (1 + np.exp(-X @ np.array([0.3, 1.0, -1.0])))).astype(np.float32)
    return jnp.asarray(X, jnp.float32), jnp.asarray(y)


def test_adaptive_decay_numbers():
    s = nb.adaptive_decay(0.5, 10)
    assert s.averaging and s.power == 0.5
    for c in [0.0, 3.0, 30.0, 990.0]:
        assert s(c) == pytest.approx(0.5 / (1 + c / 10))  # the averaging weight gamma
        assert s.iterate(c) == pytest.approx(0.5 / np.sqrt(1 + c / 10))  # the iterate's step rho
        assert s.iterate(s.skipped(c)) == pytest.approx(s.iterate(c) / 2)  # a skip halves rho
    assert s.skipped(0.0) == pytest.approx(30.0)  # 4c + 3 tau
    plain = nb.adaptive_decay(0.5, 10, averaging=False)  # the previous default: one step size
    assert not plain.averaging and plain.power == 1.0
    for c in [0.0, 3.0, 990.0]:
        assert plain.iterate(c) == plain(c) == pytest.approx(0.5 / (1 + c / 10))
        assert plain.skipped(c) == pytest.approx(2 * c + 10)
    assert repr(plain) == "adaptive_decay(0.5, 10.0, averaging=False)"
    with pytest.raises(ValueError, match="averaging"):
        nb.adaptive_decay(0.5, 10, averaging="yes")


def test_what_the_average_weighs():
    """With one clock unit per step, gamma = 0.5 / (1 + c/10) = 5 / (10 + c) gives the iterate taken at
    clock c the weight (c + 6)(c + 7)(c + 8)(c + 9) / sum (polynomial-decay averaging of degree 4): the
    iterates from before clock c0 keep a share of about ((c0 + 7.5) / (c + 7.5))^5 (2.6e-4 at clock 80
    for those before clock 10: the approach is forgotten, and what is left after 100 steps is Monte
    Carlo noise, bench/bench_steps.py --floor), and on independent noise the average's variance is
    25/9 = 2.8 times the plain mean's (the price of that memory; docs/blr.md Section 5)."""
    s = nb.adaptive_decay(0.5, 10)
    n = 400
    weights = np.zeros(n + 2)
    weights[0] = 1.0  # the initial average: the initial guide
    for c in range(n + 1):  # the step at clock c: average <- average + gamma(c) (x_c - average)
        gamma = s(float(c))
        weights *= 1 - gamma
        weights[c + 1] += gamma
    assert weights[0] < 1e-8  # the initialisation is forgotten
    clock = np.arange(n + 1)
    quartic = (clock + 6) * (clock + 7) * (clock + 8) * (clock + 9)
    np.testing.assert_allclose(weights[1:], quartic / np.sum(quartic), rtol=1e-6)
    share = np.cumsum(quartic[:81])
    assert share[9] / share[80] == pytest.approx((17.5 / 87.5) ** 5, rel=0.25)  # 2.6e-4 exactly
    assert share[9] / share[80] < 4e-4
    assert np.sum(weights**2) * (n + 2) == pytest.approx(25 / 9, rel=0.02)


@pytest.mark.parametrize("guide_cls, loc, scale, constraint", [
    (AutoNormal, "w_auto_loc", "w_auto_scale", constraints.softplus_positive),
    (AutoMultivariateNormal, "auto_loc", "auto_scale_tril", constraints.scaled_unit_lower_cholesky),
])
@pytest.mark.slow
def test_the_state_averages_the_iterates(small_logistic, guide_cls, loc, scale, constraint):
    """With m, L (or s) the iterate's mean and Cholesky factor (or scale):
    average_t = average_{t-1} + gamma(c_t) ((m_t, L_t) - average_{t-1}), from average_0 = (m_0, L_0);
    the iterate steps with rho = iterate(c_{t-1}); get_params returns the average's raw parameters."""
    X, y = small_logistic
    opt = nb.BLR()
    svi = SVI(logistic_model, guide_cls(logistic_model), opt, Trace_ELBO())
    state = svi.init(jax.random.PRNGKey(0), X, y)
    transform = biject_to(constraint)

    def moments(raw):
        return {loc: np.asarray(raw[loc]), scale: np.asarray(transform(raw[scale]))}

    s = state.optim_state[1]
    assert sorted(s.algorithm.average) == sorted([loc, scale])
    for n, v in moments(s.params).items():
        np.testing.assert_allclose(s.algorithm.average[n], v, rtol=1e-6)
    schedule = nb.adaptive_decay(0.5, 10)
    update = jax.jit(lambda st: svi.update(st, X, y))
    for _ in range(25):
        new_state, _ = update(state)
        old, new = state.optim_state[1], new_state.optim_state[1]
        assert float(new.algorithm.trace.rho) == pytest.approx(schedule.iterate(float(old.algorithm.trace.clock)), rel=1e-5)
        gamma = schedule(float(new.algorithm.trace.clock))
        for n, v in moments(new.params).items():
            expected = np.asarray(old.algorithm.average[n]) + gamma * (v - np.asarray(old.algorithm.average[n]))
            np.testing.assert_allclose(new.algorithm.average[n], expected, rtol=1e-5, atol=1e-6)
        state = new_state
    s = state.optim_state[1]
    params = opt.get_params(state.optim_state)
    for n, v in moments(params).items():
        np.testing.assert_allclose(v, s.algorithm.average[n], rtol=1e-5, atol=1e-6)
        assert not np.allclose(v, moments(s.params)[n])  # the iterate is noisier than the average


@pytest.mark.parametrize("lr", [0.1, pytest.param(nb.harmonic_decay(0.5, 10), marks=pytest.mark.slow),
                                pytest.param(nb.adaptive_decay(0.5, 10, averaging=False), marks=pytest.mark.slow)])
def test_explicit_step_sizes_keep_no_average(small_logistic, lr):
    X, y = small_logistic
    opt = nb.BLR(lr)
    svi = SVI(logistic_model, AutoNormal(logistic_model), opt, Trace_ELBO())
    result = svi.run(jax.random.PRNGKey(0), 5, X, y, progress_bar=False)
    s = result.state.optim_state[1]
    assert s.algorithm.average == {}
    for k, v in opt.get_params(result.state.optim_state).items():
        np.testing.assert_array_equal(v, s.params[k])


@pytest.mark.slow
def test_averaging_false_is_the_previous_default(small_logistic):
    """Every block steps with gamma = 0.5 / (1 + c/10) itself."""
    X, y = small_logistic
    svi = SVI(logistic_model, AutoNormal(logistic_model), nb.BLR(nb.adaptive_decay(0.5, 10, averaging=False)), Trace_ELBO())
    state = svi.init(jax.random.PRNGKey(0), X, y)
    update = jax.jit(lambda st: svi.update(st, X, y))
    for _ in range(10):
        new_state, _ = update(state)
        clock = float(state.optim_state[1].algorithm.trace.clock)
        assert float(new_state.optim_state[1].algorithm.trace.rho) == pytest.approx(0.5 / (1 + clock / 10), rel=1e-5)
        state = new_state


def _nan_model(X, y=None, broken=False):
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    if broken:
        numpyro.factor("broken", jnp.nan * jnp.sum(w))
    numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


@pytest.mark.slow
@pytest.mark.parametrize("stable", [False, True])
def test_a_skipped_step_leaves_the_average(small_logistic, stable):
    X, y = small_logistic
    svi = SVI(_nan_model, AutoMultivariateNormal(_nan_model), nb.BLR(), Trace_ELBO())
    state = svi.run(jax.random.PRNGKey(0), 5, X, y, progress_bar=False).state  # a few good steps
    before = state.optim_state[1].algorithm.average
    result = svi.run(jax.random.PRNGKey(1), 3, X, y, broken=True, progress_bar=False, stable_update=stable, init_state=state)
    s = result.state.optim_state[1]
    assert int(s.skipped) == 3  # counted in both modes; stable_update keeps the step count
    for n, v in before.items():
        np.testing.assert_array_equal(s.algorithm.average[n], v)


def eight_schools_centred(sigma, y=None):
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = numpyro.sample("tau", dist.HalfCauchy(5.0))
    with numpyro.plate("school", sigma.shape[0]):
        theta = numpyro.sample("theta", dist.Normal(mu, tau))
        numpyro.sample("y", dist.Normal(theta, sigma), obs=y)


@pytest.mark.slow
def test_centred_eight_schools_funnel_is_not_slowed_by_the_decay():
    """A funnel: the mean of log tau and the sds of theta drift slowly under very noisy curvature
    estimates. With the previous default (every block stepping with 0.5/(1 + c/10)) the ELBO was still
    rising after 4,000 steps; the averaged default is past that after 1,000."""
    y = jnp.array([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0])
    sigma = jnp.array([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0])
    with jax.enable_x64(True):
        y, sigma = y.astype(jnp.float64), sigma.astype(jnp.float64)

        def elbo(lr, steps):
            guide = AutoMultivariateNormal(eight_schools_centred)
            svi = SVI(eight_schools_centred, guide, nb.BLR(lr), Trace_ELBO())
            result = svi.run(jax.random.PRNGKey(0), steps, sigma, y, progress_bar=False)
            loss = Trace_ELBO(num_particles=2000).loss(jax.random.PRNGKey(1), result.params, eight_schools_centred, guide, sigma, y)
            return -float(loss)

        new = elbo(None, 1000)
        previous = elbo(nb.adaptive_decay(0.5, 10, averaging=False), 4000)
    assert new > previous + 0.3, (new, previous)

"""BayesBiNN (Meng, Bachmann & Khan 2020) checked against the published equations in numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from numpyro_blr import bayesbinn
from numpyro_blr.bayesbinn import mean, predictive, sample_binary
from numpyro_blr.estimators.relaxation import gradient_scale, gumbel_softmax_from_grads, relaxed_sample
from numpyro_blr.families import SignBernoulli

SHAPES = {"w": (3, 4), "b": (4,)}


def _update(opt, grads, us, state, ess, tau=1.0):
    """The rule alone on the Gumbel-softmax estimate from gradients ``grads`` at the relaxed draws of ``us``."""
    return opt.update(state, gumbel_softmax_from_grads(state, grads, us, ess, tau))[0]


def _numpy_step(lam, mom, prior, grads, us, t, *, lr, ess, tau, beta, reweight):
    """One BayesBiNN step (Meng et al. 2020, Alg. 1 / reference optimizer), float64, one leaf."""
    mu = np.tanh(lam)
    g_hat = np.zeros_like(lam)
    for g, u in zip(grads, us):
        w = np.tanh((lam + 0.5 * np.log(u / (1 - u))) / tau)
        g_hat += (1 - w**2) / (tau * (1 - mu**2)) * g
    g_hat *= ess / len(grads)
    mom = beta * mom + (1 - beta) * (g_hat + reweight * (lam - prior))
    lam = lam - lr * mom / (1 - beta**t)
    return lam, mom


def test_update_matches_published_equations_with_injected_noise():
    rng = np.random.default_rng(0)
    hyper = dict(lr=0.01, ess=100.0, tau=0.7, beta=0.9, reweight=0.5)
    opt = bayesbinn(lr=hyper["lr"], ess=hyper["ess"], temperature=hyper["tau"], beta=hyper["beta"],
                    reweight=hyper["reweight"], mc_samples=2)
    prior = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    state = opt.init(jax.random.PRNGKey(0), prior, prior_lam=prior)
    lam0 = {k: (1.5 * rng.normal(size=s)).astype(np.float32) for k, s in SHAPES.items()}
    state = state._replace(lam=lam0)
    ref_lam, ref_mom = ({k: v.astype(np.float64) for k, v in lam0.items()},
                        {k: np.zeros(s) for k, s in SHAPES.items()})
    update = jax.jit(lambda g, u, s: _update(opt, g, u, s, hyper["ess"], hyper["tau"]))
    for t in (1, 2, 3):
        us = [{k: rng.uniform(0.05, 0.95, size=s).astype(np.float32) for k, s in SHAPES.items()} for _ in range(2)]
        grads = [{k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()} for _ in range(2)]
        state = update(grads, us, state)
        for k in SHAPES:
            ref_lam[k], ref_mom[k] = _numpy_step(
                ref_lam[k], ref_mom[k], prior[k].astype(np.float64), [g[k] for g in grads],
                [u[k].astype(np.float64) for u in us], t, **hyper)
            np.testing.assert_allclose(state.lam[k], ref_lam[k], rtol=2e-4, atol=2e-4)
            np.testing.assert_allclose(state.momentum[k], ref_mom[k], rtol=2e-4, atol=2e-4)
    assert int(state.count) == 3


@pytest.mark.slow
def test_step_is_sample_then_update():
    opt = bayesbinn(lr=0.05, ess=10.0, temperature=1.0, mc_samples=1)
    state = opt.init(jax.random.PRNGKey(0), {k: jnp.zeros(s) for k, s in SHAPES.items()})
    loss_fn = lambda w: jnp.sum(w["w"] ** 2) + jnp.sum(jnp.sin(w["b"]))  # noqa: E731
    key = jax.random.PRNGKey(3)
    new, info = jax.jit(lambda k, s: opt.step(k, s, loss_fn))(key, state)
    w, u = relaxed_sample(jax.random.split(key, 1)[0], state.lam, 1.0)
    by_hand = jax.jit(lambda g, u, s: _update(opt, g, u, s, 10.0))(jax.grad(loss_fn)(w), u, state)
    np.testing.assert_allclose(info.loss, loss_fn(w), rtol=1e-6)
    for k in SHAPES:
        np.testing.assert_allclose(new.lam[k], by_hand.lam[k], rtol=1e-6)


def test_scale_is_stable_in_float32():
    lam = jnp.array([0.3, 8.0, 30.0, -60.0], jnp.float32)
    u = jnp.array([0.4, 0.5, 0.9, 0.1], jnp.float32)
    s = gradient_scale(lam, u, 1.0)
    assert np.all(np.isfinite(np.asarray(s))) and np.all(np.asarray(s) > 0)
    # moderate values equal the textbook formula
    w = SignBernoulli.relaxed_from_uniform(lam[0], u[0], 1.0)
    np.testing.assert_allclose(s[0], (1 - w**2) / (1 - jnp.tanh(lam[0]) ** 2), rtol=1e-5)
    assert float(s[3]) <= 1e10 * (1 + 1e-6)


def test_binary_predictions():
    opt = bayesbinn(lr=0.1, ess=10.0)
    state = opt.init(jax.random.PRNGKey(0), {"w": jnp.zeros(2000)})
    state = state._replace(lam={"w": jnp.linspace(-2.0, 2.0, 2000)})
    m = mean(state)["w"]
    assert set(np.unique(np.asarray(m))) == {-1.0, 1.0}
    np.testing.assert_array_equal(m, np.where(np.linspace(-2, 2, 2000) <= 0, -1.0, 1.0))
    draws = jax.jit(jax.vmap(lambda k: sample_binary(k, state)["w"]))(jax.random.split(jax.random.PRNGKey(1), 400))
    np.testing.assert_array_equal(opt.sample(jax.random.PRNGKey(1), state, 400)["w"], draws)
    assert set(np.unique(np.asarray(draws))) == {-1.0, 1.0}
    # E[w] = tanh(lam): 400 draws, sd <= 1/sqrt(400) = 0.05 per weight; check a smoothed mean
    np.testing.assert_allclose(draws.mean(0).reshape(20, 100).mean(1),
                               np.tanh(np.linspace(-2, 2, 2000)).reshape(20, 100).mean(1), atol=0.03)


@pytest.mark.slow
def test_trains_binary_classifier_on_separable_toy_problem():
    rng = np.random.default_rng(0)
    d, n = 16, 400
    w_true = rng.choice([-1.0, 1.0], size=d)
    X = rng.normal(size=(n, d)).astype(np.float32)
    y = (X @ w_true > 0).astype(np.float32)
    X, y = jnp.asarray(X), jnp.asarray(y)

    def loss_fn(w, x, t):
        logits = 3.0 * x @ w["w"] / np.sqrt(d)
        return jnp.mean(jax.nn.softplus(logits) - t * logits)

    opt = bayesbinn(lr=0.003, ess=float(n), temperature=1.0, beta=0.9, lam_init=1.0)
    state = opt.init(jax.random.PRNGKey(0), {"w": jnp.zeros(d)})

    @jax.jit
    def run(state, key):
        return jax.lax.scan(lambda s, k: opt.step(k, s, loss_fn, X, y), state, jax.random.split(key, 1200))

    state, info = run(state, jax.random.PRNGKey(1))
    assert int(state.skipped) == 0 and not bool(jnp.any(info.skipped))
    acc = float(jnp.mean(((X @ mean(state)["w"]) > 0) == (y > 0)))
    assert acc >= 0.97, acc
    np.testing.assert_array_equal(mean(state)["w"], w_true)
    probs = predictive(jax.random.PRNGKey(2), state, lambda w, x: jax.nn.sigmoid(3.0 * x @ w["w"] / np.sqrt(d)), X, 16)
    assert float(jnp.mean((probs > 0.5) == (y > 0))) >= 0.95


@pytest.mark.parametrize("bad", [dict(lr=-1.0), dict(ess=0.0), dict(temperature=0.0), dict(beta=1.0), dict(mc_samples=0)])
def test_rejects_bad_hyperparameters(bad):
    kw = dict(lr=0.1, ess=10.0) | bad
    with pytest.raises(ValueError):
        bayesbinn(**kw)

"""IVON as a NumPyro optimizer (numpyro_blr.deep.IVON) under SVI."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest
from numpyro.infer import SVI, Predictive, Trace_ELBO
from numpyro.infer.autoguide import AutoDiagonalNormal, AutoMultivariateNormal, AutoNormal
from numpyro.infer.util import potential_energy

from numpyro_blr.deep import IVON, ivon, price_from_samples
from numpyro_blr.layout import GuideLayoutError

N = 30
_rng = np.random.default_rng(0)
X = jnp.asarray(_rng.standard_normal((N, 3)), jnp.float32)
Y = jnp.asarray(X @ np.array([1.0, -0.5, 0.3]) + 0.5 + 0.5 * _rng.standard_normal(N), jnp.float32)


def regression(x, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    numpyro.sample("y", dist.Normal(x @ w + b, 0.5), obs=y)


def exact_posterior():
    A = np.hstack([np.asarray(X, np.float64), np.ones((N, 1))])
    prec = np.eye(4) + A.T @ A / 0.25
    cov = np.linalg.inv(prec)
    return cov @ A.T @ np.asarray(Y, np.float64) / 0.25, np.sqrt(np.diag(cov))


@pytest.mark.slow
def test_equivalent_to_pure_ivon_on_the_same_gradients():
    # The single-sample ELBO with a fixed eps, L = U(m + sd*eps) - sum log sd, is what Trace_ELBO computes
    # (up to a constant). By the mapping, IVON-for-SVI must equal ivon() on lbar = U/ess with noise sd*eps.
    ess, hyper = float(N), dict(lr=0.3, hess_init=0.5, beta1=0.9, beta2=0.8, weight_decay=0.05, clip_radius=5.0)
    opt = IVON(ess=ess, **hyper)
    # AutoNormal's parameter names (built by hand: SVI.init would only add a compile)
    params = {"w_auto_loc": jnp.asarray([0.5, -1.0, 0.2]), "w_auto_scale": jnp.zeros(3),
              "b_auto_loc": jnp.asarray(0.3), "b_auto_scale": jnp.asarray(0.0)}
    sites = ["b", "w"]
    _, state = opt.init(params)
    sd0 = jax.nn.softplus(state.params["w_auto_scale"])
    np.testing.assert_allclose(sd0, 1 / np.sqrt(ess * (0.5 + 0.05)), rtol=1e-5)

    pot = lambda z: potential_energy(regression, (X, Y), {}, z)
    ref = ivon(ess=ess, **hyper)
    ref_state = ref.init({k: params[f"{k}_auto_loc"] for k in sites})
    ref_update = jax.jit(lambda th, noise, rs: ref.update(
        rs, price_from_samples(rs, jax.tree.map(lambda g: g / ess, jax.grad(pot)(th)), noise, ess))[0])
    step = jax.jit(lambda fn_eps, st: opt.eval_and_update(lambda p: elbo(p, fn_eps), st))

    def elbo(p, eps):
        sd = {k: jax.nn.softplus(p[f"{k}_auto_scale"]) for k in sites}
        z = {k: p[f"{k}_auto_loc"] + sd[k] * eps[k] for k in sites}
        return pot(z) - sum(jnp.sum(jnp.log(v)) for v in sd.values()), None

    st = (jnp.array(0), state)
    for t in range(5):
        keys = jax.random.split(jax.random.key(t + 1), 2)
        eps = {k: jax.random.normal(kk, jnp.shape(params[f"{k}_auto_loc"])) for k, kk in zip(sites, keys)}
        p = st[1].params
        noise = {k: jax.nn.softplus(p[f"{k}_auto_scale"]) * eps[k] for k in sites}
        theta = jax.tree.map(jnp.add, ref_state.params, noise)
        ref_state = ref_update(theta, noise, ref_state)
        _, st = step(eps, st)
        for k in sites:
            np.testing.assert_allclose(st[1].params[f"{k}_auto_loc"], ref_state.params[k], rtol=1e-4, atol=1e-5)
            sd = jax.nn.softplus(st[1].params[f"{k}_auto_scale"])
            np.testing.assert_allclose(sd, 1 / np.sqrt(ess * ref_state.tree(ref_state.precision)[k]), rtol=1e-4)
            np.testing.assert_allclose(st[1].algorithm.momentum[f"{k}_auto_loc"], ref_state.tree(ref_state.momentum)[k], rtol=1e-4, atol=1e-6)
    assert int(st[0]) == 5 and int(st[1].algorithm.count) == 5 and int(st[1].skipped) == 0


@pytest.mark.slow
def test_svi_run_recovers_the_conjugate_posterior():
    guide = AutoNormal(regression)
    svi = SVI(regression, guide, IVON(lr=0.2, ess=N, hess_init=1.0, beta2=0.99), Trace_ELBO(num_particles=4))
    res = svi.run(jax.random.key(1), 1000, X, Y, progress_bar=False)
    assert np.all(np.isfinite(res.losses)) and np.mean(res.losses[-100:]) < np.mean(res.losses[:20])
    mean, sd = exact_posterior()
    m = np.concatenate([res.params["w_auto_loc"], [res.params["b_auto_loc"]]])
    s = np.concatenate([res.params["w_auto_scale"], [res.params["b_auto_scale"]]])  # res.params are constrained
    # mean within a third of a posterior s.d.; a diagonal Gaussian's KL-optimal s.d. is the conditional
    # one, 1/sqrt(diag(precision)), smaller than the exact marginal s.d.
    A = np.hstack([np.asarray(X, np.float64), np.ones((N, 1))])
    cond_sd = 1 / np.sqrt(np.diag(np.eye(4) + A.T @ A / 0.25))
    assert np.max(np.abs(m - mean) / sd) < 0.35
    np.testing.assert_allclose(s, cond_sd, rtol=0.15)
    state = res.state.optim_state[1]
    assert int(state.skipped) == 0 and int(state.algorithm.count) == 1000


@pytest.mark.slow
def test_run_modes_agree_autodiagonalnormal():
    # progress_bar=False (lax.scan) and progress_bar=True (python loop) with stable_update give the same run
    guide = AutoDiagonalNormal(regression)
    svi = SVI(regression, guide, IVON(lr=0.2, ess=N, beta2=0.99), Trace_ELBO())
    runs = [svi.run(jax.random.key(4), 100, X, Y, progress_bar=pb, stable_update=st)
            for pb, st in [(False, False), (True, True)]]
    for r in runs[1:]:
        np.testing.assert_allclose(r.losses, runs[0].losses, rtol=1e-3, atol=1e-3)
        for k in ("auto_loc", "auto_scale"):
            np.testing.assert_allclose(r.params[k], runs[0].params[k], rtol=1e-4, atol=1e-5)
    assert np.mean(runs[0].losses[-20:]) < np.mean(runs[0].losses[:5])


def mlp_model(x, y=None, hidden=16):
    """A plain-JAX Bayesian MLP: numpyro.sample weights with a N(0, 1) prior."""
    sizes = [(x.shape[1], hidden), (hidden, 2)]
    h = x
    for i, (a, b) in enumerate(sizes):
        w = numpyro.sample(f"w{i}", dist.Normal(0.0, 1.0).expand([a, b]).to_event(2))
        c = numpyro.sample(f"b{i}", dist.Normal(0.0, 1.0).expand([b]).to_event(1))
        h = h @ w + c
        if i == 0:
            h = jnp.tanh(h)
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Categorical(logits=h), obs=y)


@pytest.mark.slow
def test_bayesian_mlp_trains_and_predicts():
    from sklearn.datasets import make_moons

    x, y = make_moons(200, noise=0.15, random_state=0)
    x, y = jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.int32)
    guide = AutoNormal(mlp_model)
    svi = SVI(mlp_model, guide, IVON(lr=0.3, ess=len(y), hess_init=0.1, beta2=0.999), Trace_ELBO())
    res = svi.run(jax.random.key(2), 800, x, y, progress_bar=False)
    assert np.mean(res.losses[-50:]) < 0.5 * np.mean(res.losses[:20])
    post = Predictive(mlp_model, guide=guide, params=res.params, num_samples=16, return_sites=["y"])
    draws = post(jax.random.key(3), x)["y"]
    assert draws.shape == (16, len(y))
    assert np.mean(np.mean(np.asarray(draws), 0).round() == np.asarray(y)) > 0.9


@pytest.mark.slow
def test_nonfinite_step_is_skipped_and_flagged():
    opt = IVON(lr=0.1, ess=10.0)
    i, state = opt.init({"w_auto_loc": jnp.zeros(2), "w_auto_scale": jnp.zeros(2)})
    nan_fn = lambda p: (jnp.sum(p["w_auto_loc"]) * jnp.nan, None)
    (loss, _), (j, new) = opt.eval_and_update(nan_fn, (i, state))
    assert int(j) == 1 and any(bool(v) for v in new.nonfinite.values()) and int(new.skipped) == 1
    assert int(new.algorithm.count) == 0
    for k in state.params:
        np.testing.assert_array_equal(new.params[k], state.params[k])
    (loss, _), (j, new) = opt.eval_and_stable_update(nan_fn, (i, state))
    assert int(j) == 0 and np.isnan(loss) and int(new.skipped) == 1
    good = lambda p: (jnp.sum(p["w_auto_loc"] ** 2) - jnp.sum(jnp.log(jax.nn.softplus(p["w_auto_scale"]))), None)
    (_, _), (j, new) = opt.eval_and_stable_update(good, (j, new))
    # the last step was not skipped (the count of skipped steps stays 1) and IVON took it
    assert int(j) == 1 and int(new.skipped) == 1 and int(new.algorithm.count) == 1


@pytest.mark.slow
def test_guides_it_cannot_read_and_fallback():
    with pytest.raises(ValueError, match="ess"):
        IVON(lr=0.1)
    svi = SVI(regression, AutoMultivariateNormal(regression), IVON(lr=0.1, ess=N), Trace_ELBO())
    with pytest.raises(GuideLayoutError, match="diagonal"):
        svi.init(jax.random.key(0), X, Y)

    def with_param(x, y=None):
        noise = numpyro.param("noise", 0.5, constraint=dist.constraints.positive)
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
        numpyro.sample("y", dist.Normal(x @ w, noise), obs=y)

    with pytest.raises(GuideLayoutError, match="fallback"):
        SVI(with_param, AutoNormal(with_param), IVON(lr=0.1, ess=N), Trace_ELBO()).init(jax.random.key(0), X, Y)
    svi = SVI(with_param, AutoNormal(with_param), IVON(lr=0.1, ess=N, fallback=optax.adam(0.05)), Trace_ELBO())
    res = svi.run(jax.random.key(0), 300, X, Y, progress_bar=False)
    assert np.all(np.isfinite(res.losses)) and float(res.params["noise"]) != 0.5


def _eqx_model(prior):
    import equinox as eqx
    from numpyro.contrib.module import random_eqx_module

    linear = eqx.nn.Linear(3, 1, key=jax.random.key(0))

    def model(x, y=None):
        net = random_eqx_module("net", linear, prior=prior)
        mu = jax.vmap(net)(x)[:, 0]
        numpyro.sample("y", dist.Normal(mu, 0.5), obs=y)

    return model


@pytest.mark.slow
def test_unread_module_placeholder_is_passed_through():
    # random_eqx_module registers "net$params" (the eqx module's weights) next to the latent sites
    # "net/weight", "net/bias"; with a prior on every weight the ELBO never reads it.
    model = _eqx_model(dist.Normal(0.0, 1.0))
    guide = AutoNormal(model)
    svi = SVI(model, guide, IVON(lr=0.2, ess=N, beta2=0.99), Trace_ELBO())
    state0 = svi.init(jax.random.key(0), X, Y)
    placeholder = svi.get_params(state0)["net$params"]
    res = svi.run(jax.random.key(1), 1000, X, Y, progress_bar=False)
    for a, b in zip(jax.tree.leaves(res.params["net$params"]), jax.tree.leaves(placeholder)):
        np.testing.assert_array_equal(a, b)
    assert np.all(np.isfinite(res.losses)) and np.mean(res.losses[-50:]) < np.mean(res.losses[:20])
    assert int(res.state.optim_state[1].skipped) == 0
    # the Gaussian part is the conjugate posterior (the Linear weight is (1, 3), bias (1,))
    mean, sd = exact_posterior()
    m = np.concatenate([np.ravel(res.params["net/weight_auto_loc"]), np.ravel(res.params["net/bias_auto_loc"])])
    assert np.max(np.abs(m - mean) / sd) < 0.5


@pytest.mark.slow
def test_read_module_placeholder_needs_fallback():
    # no prior for the bias: the model reads it from "net$params", which IVON cannot update
    model = _eqx_model({"weight": dist.Normal(0.0, 1.0)})
    svi = SVI(model, AutoNormal(model), IVON(lr=0.2, ess=N), Trace_ELBO())
    state = svi.init(jax.random.key(0), X, Y)
    with pytest.raises(GuideLayoutError, match="fallback"):
        svi.update(state, X, Y)
    svi = SVI(model, AutoNormal(model), IVON(lr=0.2, ess=N, fallback=optax.adam(0.05)), Trace_ELBO())
    res = svi.run(jax.random.key(0), 300, X, Y, progress_bar=False)
    assert np.all(np.isfinite(res.losses))

"""What keeps a BLR step small to compile (issue 12, item 6), checked on the traced program, not on
wall times: the loss's parameter-free work is traced once per step, as in an Adam step."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.infer import SVI, Trace_ELBO
from numpyro.infer.autoguide import AutoMultivariateNormal, AutoNormal
import pytest

import numpyro_blr as nb
from numpyro_blr.estimators import hoist_constant_work

RANDOM = ("random_bits", "threefry2x32")


def _model(x, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    s = numpyro.sample("s", dist.HalfNormal(1.0))
    numpyro.sample("y", dist.Normal(x @ w, s), obs=y)


def _data():
    x = np.random.default_rng(0).normal(size=(30, 2))
    return jnp.asarray(x), jnp.asarray(x @ np.array([0.5, -1.0]) + 0.3)


def _count(jaxpr, names):
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name in names
        for v in eqn.params.values():
            for j in (v if isinstance(v, (tuple, list)) else (v,)):
                inner = getattr(j, "jaxpr", j)
                if hasattr(inner, "eqns"):
                    n += _count(inner, names)
    return n


@pytest.mark.parametrize("guide_cls", [AutoNormal, AutoMultivariateNormal])
@pytest.mark.slow
def test_a_blr_step_draws_its_random_numbers_once_like_adam(guide_cls):
    """The exact Hessian, its sample-offset column and backtracking evaluate the loss several times
    at one key; each evaluation used to carry its own random-number code (the bulk of a small model's
    program). The default step's jaxpr has as many random-number equations as an Adam step's; with
    ``curvature_draws=8`` one more, the optimizer's own draws of the averaged curvature (``BLR._curvature_draws``: the
    epsilons of its extra draws of q, inside the ``lax.cond`` branch that runs once the one-draw curvature is too
    noisy)."""
    x, y = _data()
    counts = {}
    for name, optim in (("adam", numpyro.optim.Adam(0.01)), ("blr", nb.BLR()), ("blr8", nb.BLR(curvature_draws=8))):
        svi = SVI(_model, guide_cls(_model), optim, Trace_ELBO())
        state = svi.init(jax.random.PRNGKey(0), x, y)
        counts[name] = _count(jax.make_jaxpr(lambda s: svi.update(s, x, y))(state).jaxpr, RANDOM)
    assert counts["adam"] > 0
    assert counts["blr"] == counts["adam"]
    assert counts["blr8"] == counts["adam"] + 1


@pytest.mark.slow
def test_hoisted_loss_is_the_loss():
    """Same values and derivatives as the loss, at the traced parameters and elsewhere."""
    x, y = _data()
    svi = SVI(_model, AutoNormal(_model), numpyro.optim.Adam(0.01), Trace_ELBO())
    state = svi.init(jax.random.PRNGKey(0), x, y)
    params = svi.optim.get_params(state.optim_state)
    from numpyro.infer.svi import _make_loss_fn

    def check(key):
        fn = _make_loss_fn(svi.loss, key, svi.constrain_fn, svi.model, svi.guide, (x, y), {}, svi.static_kwargs)
        fast = hoist_constant_work(fn, params)
        moved = jax.tree.map(lambda p: p + 0.3, params)
        out = []
        for p in (params, moved):
            out.append((fn(p)[0], fast(p)[0], jax.grad(lambda q: fn(q)[0])(p), jax.grad(lambda q: fast(q)[0])(p)))
        return out

    for a, b, ga, gb in jax.jit(check)(jax.random.PRNGKey(3)):
        np.testing.assert_allclose(a, b, rtol=1e-5)  # float32: equal to rounding
        jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6), ga, gb)


def test_hoisted_function_takes_other_shapes_to_the_function_itself():
    noise = jax.random.normal(jax.random.PRNGKey(0), (3,))

    def fn(p):
        return jnp.sum(jnp.sin(p["a"]) * jnp.sum(noise)), None

    fast = hoist_constant_work(fn, {"a": jnp.zeros(3)})
    for a in (jnp.ones(3), jnp.ones(4)):
        np.testing.assert_allclose(fast({"a": a})[0], fn({"a": a})[0], rtol=1e-6)

"""Compile once (issue 24, item 5): a second ``vmp``/``ncvmp``/``svi``/``em`` object on the same model, options and
shapes reuses the first one's compiled programs (construction checks, prior, sweep, ELBO, posterior), and gets the
results a computation of its own would give.

Two counts, by ``jax.monitoring``: XLA backend compilations and lowerings to MLIR (a program lowered again is
one not found in memory: also one read back from the persistent compilation cache of tests/conftest.py, which
does not compile). A "fresh" computation is the same model function copied (another function object: nothing
shared), so the reference is traced and compiled on its own.
"""

import contextlib
import gc
import types
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import monitoring

from numpyro_blr.infer import em, ncvmp, svi, vmp

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
LOWERING = "/jax/core/compile/jaxpr_to_mlir_module_duration"


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


@contextlib.contextmanager
def compiles():
    """Counts ``{"compile": backend compilations, "lower": lowerings}`` in the block."""
    counts = {"compile": 0, "lower": 0}

    def listener(event, duration, **kwargs):
        if event == BACKEND_COMPILE:
            counts["compile"] += 1
        elif event == LOWERING:
            counts["lower"] += 1

    monitoring.register_event_duration_secs_listener(listener)
    try:
        yield counts
    finally:
        monitoring.unregister_event_duration_listener(listener)


def copy(fn):
    """The same model as another function object: an object built on it shares no compiled program."""
    return types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def naturals(state):
    return [np.asarray(x) for x in jax.tree.leaves(state.natural)]


def assert_same(a, b, rtol=1e-10):
    for x, y in zip(naturals(a), naturals(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=rtol)


def assert_differ(a, b):
    assert any(not np.allclose(x, y) for x, y in zip(naturals(a), naturals(b), strict=True))


# ---------------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------------


def normal_mean(y, prior_scale=10.0):
    mu = numpyro.sample("mu", dist.Normal(0.0, prior_scale))
    with numpyro.plate("n", y.shape[0]):
        numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)


def normal_gamma(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    tau = numpyro.sample("tau", dist.Gamma(1.0, 1.0))
    with numpyro.plate("n", y.shape[0]):
        numpyro.sample("y", dist.Normal(mu, 1.0 / jnp.sqrt(tau)), obs=y)


def logistic(X, y):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


K = 2


def mixture(y, batch=None):
    w = numpyro.sample("w", dist.Dirichlet(jnp.ones(K)))
    with numpyro.plate("k", K):
        mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    with numpyro.plate("n", y.shape[0], subsample_size=batch) as idx:
        z = numpyro.sample("z", dist.Categorical(w))
        numpyro.sample("y", dist.Normal(mu[z], 1.0), obs=y[idx])


def em_mixture(y):
    w = numpyro.param("w", jnp.ones(K) / K, constraint=dist.constraints.simplex)
    mu = numpyro.param("mu", jnp.array([-1.0, 1.0]))
    with numpyro.plate("n", y.shape[0]):
        z = numpyro.sample("z", dist.Categorical(w))
        numpyro.sample("y", dist.Normal(mu[z], 1.0), obs=y)


SCALE = jnp.asarray(10.0)  # read by global_prior: rebinding it must not reuse a program with the old value folded in


def global_prior(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, SCALE))
    with numpyro.plate("n", y.shape[0]):
        numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)


def mixture_data(n, seed):
    rng = np.random.default_rng(seed)
    return jnp.asarray(np.array([-3.0, 3.0])[rng.integers(0, K, n)] + rng.normal(0, 1, n))


def closed_form(y, prior_scale=10.0):
    """Posterior mean and precision of ``normal_mean``."""
    precision = prior_scale**-2 + len(y)
    return float(np.sum(y)) / precision, precision


# ---------------------------------------------------------------------------------------------
# vmp
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_vmp_second_object_is_exact_without_compiling():
    """One sweep of ``normal_mean`` is its closed-form posterior: the second object, on other data of the same
    shape, gets its own data's posterior and compiles nothing (construction, init, sweep, run's posterior); new
    shapes compile and are exact too."""
    rng = np.random.default_rng(0)
    ya, yb, yc = rng.normal(1.0, 1.0, 20), rng.normal(-2.0, 1.0, 20), rng.normal(0.5, 1.0, 31)
    fits = {}
    for name, y in (("a", ya), ("b", yb), ("c", yc)):
        with compiles() as counts:
            algo = vmp(normal_mean, jnp.asarray(y))
            res = algo.run(algo.init(), num_steps=2, tol=None, progress_bar=False)
        fits[name] = counts
        mean, precision = closed_form(y)
        np.testing.assert_allclose(float(res.posterior["mu"].loc), mean, rtol=1e-12)
        np.testing.assert_allclose(float(res.posterior["mu"].scale), precision**-0.5, rtol=1e-12)
    assert fits["a"]["lower"] > 0
    assert fits["b"] == {"compile": 0, "lower": 0}
    assert fits["c"]["lower"] > 0  # 31 points: new shapes, new programs


@pytest.mark.slow
def test_vmp_second_object_equals_a_fresh_one():
    """``normal_gamma`` (mean and precision: several sweeps): the second object's states after each of 3 sweeps
    equal those of an object on a copy of the model (traced and compiled on its own), and differ from the first
    object's; its sweeps and construction compile nothing."""
    rng = np.random.default_rng(1)
    ya, yb = jnp.asarray(rng.normal(1.0, 2.0, 25)), jnp.asarray(rng.normal(-1.0, 0.5, 25))

    def fit(model, y):
        algo = vmp(model, y)
        state, states = algo.init(), []
        for _ in range(3):
            state, _ = algo.step(None, state)
            states.append(state)
        algo.elbo(state.natural)
        return algo, states

    fit(normal_gamma, ya)
    with compiles() as build:
        algo = vmp(normal_gamma, yb)
        state = algo.init()
    with compiles() as steps:
        states = []
        for _ in range(3):
            state, _ = algo.step(None, state)
            states.append(state)
        total, _, _ = algo.elbo(state.natural)
    assert build == {"compile": 0, "lower": 0}
    assert steps == {"compile": 0, "lower": 0}
    _, fresh = fit(copy(normal_gamma), yb)
    _, first = fit(normal_gamma, ya)
    for s, f in zip(states, fresh):
        assert_same(s, f)
    assert_differ(states[-1], first[-1])
    np.testing.assert_allclose(float(total), float(fresh[-1].elbo), rtol=1e-10)


def test_a_shared_program_keeps_no_object_alive():
    """The cache holds programs, not objects: once an object and its result are dropped, its engine, graph and
    data are freed (the program's static argument drops the traced function after each call)."""

    def fit(seed):
        y = jnp.asarray(np.random.default_rng(seed).normal(size=20))
        algo = vmp(normal_mean, y)
        algo.run(algo.init(), num_steps=2, tol=None, progress_bar=False)
        return weakref.ref(algo.engine), weakref.ref(algo.graph), weakref.ref(y)

    refs = [fit(0), fit(1)]
    gc.collect()
    assert all(r() is None for rs in refs for r in rs)


def test_a_different_lr_does_not_reuse_a_program():
    """``lr`` = 0.5 (a damped step) after ``lr`` = 1 on the same data and model: other programs, and the damped
    step's own result (halfway between the prior and the exact posterior, as a fresh object's)."""
    rng = np.random.default_rng(2)
    y = jnp.asarray(rng.normal(1.0, 1.0, 20))
    algo = vmp(normal_mean, y)
    full = algo.step(None, algo.init())[0]
    with compiles() as counts:
        damped = vmp(normal_mean, y, lr=0.5)
        half = damped.step(None, damped.init())[0]
    assert counts["lower"] > 0
    fresh = vmp(copy(normal_mean), y, lr=0.5)
    assert_same(half, fresh.step(None, fresh.init())[0])
    prior = algo.init().natural["mu"]
    for a, b, p in zip(naturals(half), naturals(full), jax.tree.leaves(prior), strict=True):
        np.testing.assert_allclose(a, 0.5 * (np.asarray(p) + b), rtol=1e-12)


def test_a_different_non_array_argument_does_not_reuse_a_program():
    """A model argument that is not an array (the prior scale: a Python float, folded into the program) gives
    other programs for another value, and each object its own exact posterior."""
    y = jnp.asarray(np.random.default_rng(2).normal(1.0, 1.0, 20))
    for scale in (10.0, 0.1):
        algo = vmp(normal_mean, y, scale)
        res = algo.run(algo.init(), num_steps=1, tol=None, progress_bar=False)
        np.testing.assert_allclose(float(res.posterior["mu"].loc), closed_form(np.asarray(y), scale)[0], rtol=1e-12)


@pytest.mark.slow
def test_a_rebound_global_does_not_reuse_a_program():
    """A global array the model reads (folded into the program), rebound between two objects on the same model:
    the second object gets programs with the new value, and its own exact posterior."""
    global SCALE
    y = jnp.asarray(np.random.default_rng(2).normal(1.0, 1.0, 20))
    old = SCALE
    try:
        for scale in (10.0, 0.1):
            SCALE = jnp.asarray(scale)
            algo = vmp(global_prior, y)
            res = algo.run(algo.init(), num_steps=1, tol=None, progress_bar=False)
            np.testing.assert_allclose(float(res.posterior["mu"].loc), closed_form(np.asarray(y), scale)[0], rtol=1e-12)
    finally:
        SCALE = old


# ---------------------------------------------------------------------------------------------
# ncvmp, svi, em
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_ncvmp_second_object_equals_a_fresh_one():
    """Logistic regression (projected Gauss-Hermite steps): the construction's projection search, the checks and
    the sweeps of a second object on other data of the same shapes compile nothing, and its states equal a fresh
    object's."""
    def data(seed):
        r = np.random.default_rng(seed)
        X = np.hstack([np.ones((40, 1)), r.normal(size=(40, 2))])
        return jnp.asarray(X), jnp.asarray((r.random(40) < 0.5).astype(float))

    def fit(model, X, y):
        algo = ncvmp(model, X, y)
        state = algo.init()
        for _ in range(3):
            state, _ = algo.step(None, state)
        return state

    first = fit(logistic, *data(0))
    with compiles() as counts:
        second = fit(logistic, *data(1))
    assert counts == {"compile": 0, "lower": 0}
    assert_same(second, fit(copy(logistic), *data(1)))
    assert_differ(second, first)


@pytest.mark.slow
def test_svi_second_object_equals_a_fresh_one():
    """Stochastic VI on minibatches of a mixture: a second object on another data set of the same size, the same
    minibatch indices, takes the same steps as a fresh object and compiles nothing, nor does its whole-data ELBO
    (a VMP object built inside)."""
    init = {"mu": dist.Normal(jnp.array([-1.0, 1.0]), 1.0)}
    order = [np.random.default_rng(4).choice(100, 10, replace=False) for _ in range(3)]

    def fit(model, y):
        algo = svi(model, y, 10)
        state = algo.init(init=init)
        for idx in order:
            state, _ = algo.step(None, state, indices=idx)
        return state, algo.elbo(state)[0]

    first, _ = fit(mixture, mixture_data(100, 0))
    with compiles() as counts:
        second, elbo = fit(mixture, mixture_data(100, 1))
    assert counts == {"compile": 0, "lower": 0}
    fresh, fresh_elbo = fit(copy(mixture), mixture_data(100, 1))
    assert_same(second, fresh)
    np.testing.assert_allclose(elbo, fresh_elbo, rtol=1e-10)
    assert_differ(second, first)


@pytest.mark.slow
def test_em_second_object_equals_a_fresh_one():
    """EM on a mixture (weights and means ``numpyro.param`` sites, the assignments' exact E-step): a second object's
    sweeps and fitted parameters equal a fresh object's, with nothing compiled."""

    def fit(model, y):
        algo = em(model, y)
        res = algo.run(algo.init(), num_steps=3, tol=None, progress_bar=False)
        return res

    first = fit(em_mixture, mixture_data(60, 0))
    with compiles() as counts:
        second = fit(em_mixture, mixture_data(60, 1))
    assert counts == {"compile": 0, "lower": 0}
    fresh = fit(copy(em_mixture), mixture_data(60, 1))
    assert_same(second.state, fresh.state)
    for n in ("w", "mu"):
        np.testing.assert_allclose(second.params[n], fresh.params[n], rtol=1e-10)
    np.testing.assert_allclose(second.elbo_history, fresh.elbo_history, rtol=1e-10)
    assert_differ(second.state, first.state)

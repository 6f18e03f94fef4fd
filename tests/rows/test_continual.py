"""Continual learning with the diagonal rows: the previous task's posterior as the next task's prior.

The prior :math:`\\mathcal N(m_0, 1/(N\\delta_0))` lives in the state (``state.prior``) and replaces the weight decay:
:math:`\\hat h + \\delta_0` in the precision step, :math:`\\delta_0(m - m_0)` in the mean step.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import numpyro_blr as nb
from numpyro_blr.deep import price_from_samples
from numpyro_blr.estimators import Estimate
from numpyro_blr.rules.diagonal import DiagonalPrior, DiagonalState

RNG = np.random.default_rng(0)
PARAMS = {"w": jnp.asarray(RNG.standard_normal((3, 2)), jnp.float32), "b": jnp.zeros(2, jnp.float32)}
X = jnp.asarray(RNG.standard_normal((8, 3)), jnp.float32)
Y = jnp.asarray(RNG.standard_normal((8, 2)), jnp.float32)


def loss(p, x, y):
    return jnp.mean(jnp.sum((jnp.tanh(x @ p["w"]) + p["b"] - y) ** 2, -1))


def _flat(tree):
    return jnp.concatenate([jnp.ravel(v) for v in jax.tree.leaves(tree)])


# ----------------------------------------------------------------------------- the exact case


def test_quadratic_fixed_point_is_the_product_of_gaussians():
    """Separable quadratic task losses (a conjugate Gaussian model): task t's average loss is
    ``0.5 * sum a_t (w - c_t)^2`` over N_t examples. The posterior after task 1 (prior: the weight decay
    N(0, 1/(N_1 delta))) and after task 2 (prior: that posterior) are products of Gaussians in closed form.
    E_q[grad] and E_q[Hessian] of a quadratic are its gradient at the mean and its Hessian, so the exact
    estimate is deterministic: the rule's fixed point is then the posterior up to float32 rounding and the
    convergence of the precision averaging ((1 - rho_2)^steps = 0.5^300): rtol 1e-5."""
    d, n1, n2, delta = 5, 100.0, 40.0, 0.1
    rng = np.random.default_rng(1)
    a1, a2 = rng.uniform(0.2, 3.0, d), rng.uniform(0.2, 3.0, d)
    c1, c2 = rng.standard_normal(d), rng.standard_normal(d)
    lam1 = n1 * (a1 + delta)  # posterior 1 = N(0, 1/(n1 delta)) x likelihood 1
    mu1 = n1 * a1 * c1 / lam1
    lam2 = lam1 + n2 * a2  # posterior 2 = posterior 1 x likelihood 2
    mu2 = (lam1 * mu1 + n2 * a2 * c2) / lam2

    def fit(algo, state, a, c, steps=300):
        a, c = jnp.asarray(a, jnp.float32), jnp.asarray(c, jnp.float32)

        def body(s, _):
            return algo.update(s, Estimate(jnp.nan, a * (s.mean - c), a))[0], None

        return jax.lax.scan(body, state, None, steps)[0]

    kw = dict(beta1=0.5, beta2=0.5, hess_init=1.0)
    algo1 = nb.vogn(0.5, ess=n1, weight_decay=delta, prior=True, **kw)
    s1 = fit(algo1, algo1.init(jnp.zeros(d, jnp.float32)), a1, c1)
    np.testing.assert_allclose(s1.mean, mu1, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(n1 * s1.precision, lam1, rtol=1e-5)
    # task 2 has another ess: the prior's precision n1 p1 becomes n1 p1 / n2 per example of task 2
    algo2 = nb.vogn(0.5, ess=n2, weight_decay=delta, **kw)
    s2 = algo2.init(s1.params, prior=s1.as_prior(ess=n1))
    np.testing.assert_allclose(n2 * s2.precision, lam1, rtol=1e-6)  # the posterior starts as the prior
    s2 = fit(algo2, s2, a2, c2)
    np.testing.assert_allclose(s2.mean, mu2, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(n2 * s2.precision, lam2, rtol=1e-5)
    # and the weight decay delta is not applied on top of the prior
    np.testing.assert_allclose(s2.prior.precision, lam1 / n2, rtol=1e-6)


# ----------------------------------------------------------------------------- no prior, a zero-information prior


def _run(algo, state, steps=20, fn=loss):
    step = jax.jit(algo.step, static_argnums=2)
    for i in range(steps):
        state, _ = step(jax.random.key(i), state, fn, X, Y)
    return state


def test_absent_prior_adds_nothing_and_weight_decay_as_state_is_the_same_step():
    """No prior: the state has no ``prior`` leaves and the step has strictly fewer operations than with one
    (the option costs nothing when absent). ``prior=True`` (the weight decay carried by the state) takes
    bit-for-bit the step of the scalar weight decay."""
    plain = nb.ivon(0.05, ess=8.0, weight_decay=0.3, beta2=0.99)
    carried = nb.ivon(0.05, ess=8.0, weight_decay=0.3, beta2=0.99, prior=True)
    s0, c0 = plain.init(PARAMS), carried.init(PARAMS)
    assert s0.prior is None and len(jax.tree.leaves(s0)) == 5
    assert len(jax.tree.leaves(c0)) == 7
    n_plain = len(jax.make_jaxpr(plain.step, static_argnums=2)(jax.random.key(0), s0, loss, X, Y).eqns)
    n_carried = len(jax.make_jaxpr(carried.step, static_argnums=2)(jax.random.key(0), c0, loss, X, Y).eqns)
    assert n_plain < n_carried
    a, b = _run(plain, s0), _run(carried, c0)
    for f in ("mean", "precision", "momentum"):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f))


def test_zero_information_prior_is_no_prior():
    """A prior of precision 1e-12 per example (any mean) gives the trajectory of no prior and no weight decay
    (from the same starting precision: a given prior also starts the precision at its own, by design)."""
    plain = nb.ivon(0.05, ess=8.0, weight_decay=0.0, beta2=0.99)
    m0 = jnp.asarray(np.random.default_rng(3).standard_normal(8), jnp.float32)
    s0 = plain.init(PARAMS)
    withp = plain.init(PARAMS, prior=DiagonalPrior(m0, 1e-12))
    assert float(withp.precision[0]) == pytest.approx(1e-12)
    withp = withp._replace(precision=s0.precision)
    a, b = _run(plain, s0), _run(plain, withp)
    np.testing.assert_allclose(b.mean, a.mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(b.precision, a.precision, rtol=1e-5)


# ----------------------------------------------------------------------------- tasks in sequence


def test_new_task_does_not_recompile():
    """The prior's arrays are state: one trace of the jitted step serves every task (``init(params, prior=...)``
    gives the same structure), and the prior pulls the mean toward the previous task's."""
    traces = []

    def counted(p, x, y):
        traces.append(1)  # runs only when the step is traced
        return loss(p, x, y)

    algo = nb.ivon(0.05, ess=8.0, beta2=0.99, prior=True)
    step = jax.jit(algo.step, static_argnums=2)
    state = algo.init(PARAMS)
    for task in range(3):
        for i in range(5):
            state, _ = step(jax.random.key(10 * task + i), state, counted, X + task, Y)
        prev = state
        state = algo.init(state.params, prior=state.as_prior())
        np.testing.assert_array_equal(state.prior.mean, prev.mean)
        np.testing.assert_array_equal(state.precision, prev.precision)
        assert int(state.count) == 0 and not np.any(state.momentum)
    assert len(traces) == 1


def test_vogn_row_with_a_prior():
    """VOGN takes the prior the same way (per-example Gauss-Newton at weight samples)."""

    def per_example(p, x, y):
        return jnp.sum((jnp.tanh(x @ p["w"]) + p["b"] - y) ** 2)

    algo = nb.vogn(0.05, ess=8.0, beta2=0.9, prior=True)
    s = _run(algo, algo.init(PARAMS), 5, per_example)
    s2 = algo.init(s.params, prior=s)  # a state is its own posterior at the same ess
    np.testing.assert_array_equal(s2.prior.precision, s.precision)
    s2 = _run(algo, s2, 5, per_example)
    assert np.all(np.isfinite(s2.mean)) and int(s2.skipped) == 0


def test_optax_view_with_a_prior_equals_the_algorithm():
    """``nb.as_optax`` keeps the prior in its state: on the same draws, the view and the algorithm agree on a
    second task whose prior is the first task's posterior (``tx.init(params, prior=opt_state.as_prior(params))``)."""
    algo = nb.ivon(0.1, ess=8.0, hess_init=0.5, beta2=0.9, prior=True)
    tx = nb.as_optax(algo)

    @jax.jit
    def view_step(p, s):
        theta = nb.perturbed(algo, p, s)
        updates, s2 = tx.update(jax.grad(loss)(theta, X, Y), s, p)
        return optax.apply_updates(p, updates), s2, theta

    p, s = PARAMS, tx.init(PARAMS)
    state = algo.init(PARAMS)
    for task in range(2):
        if task:
            s = tx.init(p, prior=s.as_prior(p, ess=8.0))._replace(key=s.key)
            state = algo.init(state.params, prior=state.as_prior(ess=8.0))
            assert s.prior is not None
            np.testing.assert_allclose(s.prior.mean, state.prior.mean, rtol=1e-5, atol=1e-6)
        for _ in range(5):
            p, s, theta = view_step(p, s)
            noise = jax.tree.map(jnp.subtract, theta, state.params)
            state, _ = algo.update(state, price_from_samples(state, jax.grad(loss)(theta, X, Y), noise, 8.0))
        np.testing.assert_allclose(_flat(p), state.mean, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(s.precision, state.precision, rtol=1e-5)


# ----------------------------------------------------------------------------- validation


def test_validation_errors_name_the_argument():
    with pytest.raises(ValueError, match="^prior must be"):
        nb.ivon(0.1, ess=8.0, prior="previous")
    with pytest.raises(ValueError, match="^prior must be"):
        nb.vogn(0.1, ess=8.0, prior={"w": 1.0})
    algo = nb.ivon(0.1, ess=8.0)
    with pytest.raises(ValueError, match=r"^prior\.mean has shape \(7,\)"):
        algo.init(PARAMS, prior=DiagonalPrior(jnp.zeros(7), 1.0))
    with pytest.raises(ValueError, match=r"^prior\.precision has leaves of shapes"):
        algo.init(PARAMS, prior=DiagonalPrior(0.0, {"w": jnp.ones((2, 3)), "b": jnp.ones(2)}))
    with pytest.raises(ValueError, match=r"^prior\.precision has the structure"):
        algo.init(PARAMS, prior=DiagonalPrior(0.0, [jnp.ones((3, 2)), jnp.ones(2)]))
    with pytest.raises(ValueError, match=r"^prior\.precision must be positive"):
        algo.init(PARAMS, prior=DiagonalPrior(0.0, jnp.zeros(8)))
    with pytest.raises(ValueError, match=r"^prior\.precision must be positive"):
        algo.init(PARAMS, prior=DiagonalPrior(0.0, -1.0))
    with pytest.raises(ValueError, match=r"^prior\.mean must be finite"):
        algo.init(PARAMS, prior=DiagonalPrior(jnp.nan, 1.0))
    with pytest.raises(ValueError, match=r"^prior\.ess must be > 0"):
        algo.init(PARAMS, prior=DiagonalPrior(0.0, 1.0, ess=0.0))
    with pytest.raises(ValueError, match=r"^ess must be > 0"):
        algo.init(PARAMS).as_prior(ess=-1)
    other = algo.init({"w": jnp.zeros(4)})
    with pytest.raises(ValueError, match=r"^prior: the state given as the prior has the layout"):
        algo.init(PARAMS, prior=other)
    # a pytree like the parameters and a flat vector are both accepted, and agree
    tree = DiagonalPrior({"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}, {"w": jnp.full((3, 2), 2.0), "b": jnp.ones(2)})
    flat = DiagonalPrior(_flat(tree.mean), _flat(tree.precision))
    a, b = algo.init(PARAMS, prior=tree), algo.init(PARAMS, prior=flat)
    assert isinstance(a, DiagonalState)
    np.testing.assert_array_equal(a.prior.mean, b.prior.mean)
    np.testing.assert_array_equal(a.prior.precision, b.prior.precision)

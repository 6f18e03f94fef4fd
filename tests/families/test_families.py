"""Gamma, Beta, Dirichlet, Bernoulli and Categorical families against independent references.

* ``mu = grad A(lam)``: ``jax.grad`` of ``log_partition`` against the closed form in ``expectation``;
* round trips natural <-> user parameters and natural <-> expectation (the inverse maps solve
  digamma equations by Newton's method);
* entropy and log density against ``numpyro.distributions``;
* samples: Monte Carlo means, and the implicit reparameterisation gradient of the Gamma;
* sufficient statistics (``log q = lam . T - A``) and the NumPyro distribution of each family, and
  the registry's rows (supports, priors, guide parameters);
* BLR updates: exact at ``lr = 1`` (plain), the improved step is a retraction (agrees with the plain
  step to second order in ``lr``), the Gamma direction is the Fisher natural gradient in
  ``(a, b/a)`` (checked by autodiff), and hypothesis property tests: the improved updates keep the
  parameters valid for adversarial gradients and huge steps, without clipping.

Everything runs in float64 through a per-test ``jax.enable_x64`` context.
"""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from numpyro_blr.families.bernoulli import Bernoulli, SignBernoulli
from numpyro_blr.families.beta import Beta
from numpyro_blr.families.categorical import Categorical
from numpyro_blr.families.dirichlet import Dirichlet
from numpyro_blr.families.gamma import Gamma
from numpyro_blr.families.gaussian import FullGaussian
from numpyro_blr.families.registry import FAMILIES, allowed_families, default_family, for_prior, prior_names


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def close(a, b, rtol=1e-9, atol=1e-12):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


def tree_close(a, b, **kw):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        close(x, y, **kw)


# Each case: (family, user parameters, numpyro distribution, a value to evaluate log_prob at)
def cases():
    rng = np.random.default_rng(0)
    a = jnp.asarray(10.0 ** rng.uniform(-1.5, 2.0, size=(3, 2)))
    b = jnp.asarray(10.0 ** rng.uniform(-1.5, 1.5, size=(3, 2)))
    alpha = jnp.asarray(10.0 ** rng.uniform(-1.0, 2.0, size=(2, 4)))
    logits = jnp.asarray(rng.normal(size=(3, 2)) * 3)
    cat_logits = jnp.asarray(rng.normal(size=(2, 5)) * 2)
    return {
        "gamma": (Gamma, (a, b), dist.Gamma(a, b), jnp.asarray(rng.gamma(2.0, size=(3, 2)))),
        "beta": (Beta, (a, b), dist.Beta(a, b), jnp.asarray(rng.uniform(0.05, 0.95, size=(3, 2)))),
        "dirichlet": (Dirichlet, (alpha,), dist.Dirichlet(alpha), jnp.asarray(rng.dirichlet(np.ones(4), size=2))),
        "bernoulli": (Bernoulli, (logits,), dist.Bernoulli(logits=logits), jnp.asarray(rng.integers(0, 2, (3, 2)), float)),
        "categorical": (Categorical, (cat_logits,), dist.Categorical(logits=cat_logits), jnp.asarray(rng.integers(0, 5, 2))),
    }


NAMES = ["gamma", "beta", "dirichlet", "bernoulli", "categorical"]


def identities(fam, user, x, ref):
    """Everything the identity tests compare, computed in one compiled call per family."""
    lam = fam.to_natural(*user)
    mu = fam.expectation(lam)
    back = fam.from_natural(lam)
    return dict(
        mu=mu,
        grad_a=tuple(jax.grad(fam.log_partition)(lam)),
        lam=lam,
        back=back if isinstance(back, tuple) else (back,),
        lam_again=fam.from_expectation(mu),
        entropy=fam.entropy(*user),
        entropy_ref=jnp.sum(ref.entropy()),
        dual=fam.log_partition(lam) - sum(jnp.sum(l * m) for l, m in zip(lam, mu)),
        log_prob=fam.log_prob(x, *user),
        log_prob_ref=jnp.sum(ref.log_prob(x)),
    )


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in ("beta", "gamma") else n for n in NAMES])
def test_identities(name):
    """mu = grad A(lam) by autodiff; round trips natural <-> user and natural <-> expectation;
    entropy and log density equal NumPyro's; and H(q) = A(lam) - lam . mu (the Legendre identity,
    base measure 1), which is independent of both closed forms."""
    fam, user, ref, x = cases()[name]
    r = jax.jit(lambda user, x, ref: identities(fam, user, x, ref))(user, x, ref)
    tree_close(r["mu"], r["grad_a"], rtol=1e-10)
    back = r["back"]
    if name == "categorical":  # logits are defined up to a shift
        back = (back[0] + user[0][..., -1:],)
    tree_close(back, user, rtol=1e-12)
    tree_close(r["lam_again"], r["lam"], rtol=1e-7, atol=1e-9)
    close(r["entropy"], r["entropy_ref"], rtol=1e-8)
    close(r["entropy"], r["dual"], rtol=1e-9)
    close(r["log_prob"], r["log_prob_ref"], rtol=1e-10)


@pytest.mark.slow
def test_samples():
    """Monte Carlo means of every family's sampler (5 standard errors), the implicit
    reparameterisation gradient of the Gamma (d/da E[x] = 1/b), and the relaxed samplers' gradients.

    All Gamma-based draws share one shape, (n, 3, 2), so JAX compiles its Gamma sampler once.
    """
    c = cases()
    n = 5000
    keys = jax.random.split(jax.random.PRNGKey(0), 8)
    alpha = jnp.asarray(np.random.default_rng(1).uniform(0.5, 5.0, size=(3, 2)))
    samplers = dict(c, dirichlet=(Dirichlet, (alpha,), dist.Dirichlet(alpha), None))
    for i, name in enumerate(NAMES):
        fam, user, ref, _ = samplers[name]
        x = fam.sample(keys[i], *user, sample_shape=(n,))
        assert x.shape == (n,) + ref.batch_shape + ref.event_shape
        if name == "categorical":
            freq = jax.nn.one_hot(x, 5).mean(0)
            assert jnp.all(jnp.abs(freq - ref.probs) < 5 * jnp.sqrt(ref.probs / n) + 1e-3)
        else:
            assert jnp.all(jnp.abs(x.mean(0) - ref.mean) < 5 * jnp.sqrt(ref.variance / n) + 1e-12)
    b = jnp.full((3, 2), 2.0)
    grad_a = jax.grad(lambda a: Gamma.sample(keys[5], a, b, (n,)).mean(0).sum())(jnp.full((3, 2), 3.0))
    assert jnp.all(jnp.abs(grad_a - 1 / b) < 0.06)  # sd of the estimate ~0.01
    relaxed_grad = jax.grad(lambda l: Bernoulli.relaxed_sample(keys[6], l, 0.5, (100,)).sum())(0.3)
    assert jnp.isfinite(relaxed_grad) and relaxed_grad > 0
    close(Categorical.relaxed_sample(keys[7], jnp.zeros(3), 0.5, (4,)).sum(-1), jnp.ones(4))


def test_sign_bernoulli_is_bernoulli_in_pm1_units():
    """w = 2x - 1: lam = logits/2, E[w] = tanh(lam) = 2 sigma(logits) - 1, Var[w] = 1 - tanh^2 (stable in
    float32 where tanh saturates), exact draws with P(+1) = sigma(2 lam), and the relaxed draw equals
    2 x_r - 1 for Bernoulli's Concrete sample x_r of the same uniform."""
    logits = jnp.array([-3.0, -0.4, 0.0, 0.7, 5.0])
    lam = logits / 2
    close(SignBernoulli.expectation(lam), 2 * Bernoulli.expectation(Bernoulli.to_natural(logits)).probs - 1)
    close(SignBernoulli.log_variance(lam), jnp.log1p(-jnp.tanh(lam) ** 2), rtol=1e-7)
    big = jnp.array([30.0, -60.0], jnp.float32)  # 1 - tanh^2 is 0 in float32 here
    close(SignBernoulli.log_variance(big), np.log(4.0) - 2 * np.abs(np.asarray(big, np.float64)), rtol=1e-6)
    close(SignBernoulli.mode(lam), jnp.array([-1.0, -1.0, -1.0, 1.0, 1.0]))
    u = jnp.linspace(0.01, 0.99, 5)
    for tau in (0.5, 1.0):
        x_r = jax.nn.sigmoid((logits + jnp.log(u) - jnp.log1p(-u)) / tau)  # Bernoulli.relaxed_sample's map
        close(SignBernoulli.relaxed_from_uniform(lam, u, tau), 2 * x_r - 1, rtol=1e-9, atol=1e-12)
    draws = SignBernoulli.from_uniform(lam[None], jax.random.uniform(jax.random.PRNGKey(0), (20_000, 5)))
    assert set(np.unique(np.asarray(draws))) == {-1.0, 1.0}
    assert jnp.all(jnp.abs(draws.mean(0) - jnp.tanh(lam)) < 5 * jnp.sqrt((1 - jnp.tanh(lam) ** 2) / 20_000) + 1e-3)


# ---------------------------------------------------------------------------------------------
# BLR updates
# ---------------------------------------------------------------------------------------------


def valid_target(name, fam, user):
    """Another valid natural parameter (positive user parameters scaled, or logits shifted)."""
    if name in ("bernoulli", "categorical"):
        return fam.to_natural(*[0.5 * u - 1.0 for u in user])
    return fam.to_natural(*[3.0 * u + 1.0 for u in user])


@pytest.mark.parametrize("name", NAMES)
def test_plain_blr_step_is_exact_at_lr_one(name):
    """With grad_mu E_q[loss] = -lam_target (a conjugate term), lr = 1 lands on lam_target."""
    fam, user, _, _ = cases()[name]
    lam = fam.to_natural(*user)
    target = valid_target(name, fam, user)
    grad_mu = fam.Expectation(*[-t for t in target])
    tree_close(fam.blr_update(lam, grad_mu, 1.0, improved=False), target, rtol=1e-12)
    # and lam + grad_mu is the natural gradient, zero at the fixed point
    tree_close(fam.natural_gradient(target, grad_mu), jax.tree_util.tree_map(jnp.zeros_like, target), atol=1e-12)


@pytest.mark.parametrize("name", ["gamma", "beta", "dirichlet"])
def test_improved_step_is_a_retraction(name):
    """The improved step equals the first-order natural-gradient step up to O(lr^2)."""
    fam, user, _, _ = cases()[name]
    lam = fam.to_natural(*user)
    target = valid_target(name, fam, user)
    grad_mu = fam.Expectation(*[-t for t in target])
    ratios = []
    for lr in (1e-4, 1e-5):
        new = fam.blr_update(lam, grad_mu, lr, improved=True)
        step = jax.tree_util.tree_map(lambda n, l: (n - l) / lr, new, lam)
        ratios.append(step)
    # the per-unit-lr step converges as lr -> 0 (difference shrinks ~10x per decade)
    diff = [jnp.max(jnp.abs(a - b)) for a, b in zip(ratios[0], ratios[1])]
    scale = [jnp.max(jnp.abs(b)) for b in ratios[1]]
    assert all(d < 0.05 * s + 1e-9 for d, s in zip(diff, scale))
    # the fixed point of the plain BLR is a fixed point of the improved step, for any lr
    same = fam.blr_update(target, grad_mu, 0.7, improved=True)
    tree_close(same, target, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["gamma", "beta", "dirichlet"])
def test_improved_iterations_converge_to_conjugate_posterior(name):
    """For a conjugate term grad_mu E_q[loss] = -lam_post does not depend on q, so repeated improved
    steps with lr = 0.5 converge to lam_post (here from a far-away start)."""
    fam, user, _, _ = cases()[name]
    lam0 = fam.to_natural(*user)
    post = valid_target(name, fam, user)
    grad_mu = fam.Expectation(*[-t for t in post])
    run = jax.jit(lambda lam: jax.lax.fori_loop(0, 60, lambda _, l: fam.blr_update(l, grad_mu, 0.5), lam))
    tree_close(run(lam0), post, rtol=1e-9)


def test_gamma_direction_is_fisher_natural_gradient():
    """d = -F(eta)^{-1} grad_eta L in eta = (a, b/a), by autodiff: F(eta) = J^T (hess A) J."""
    a, b = jnp.array(2.7), jnp.array(1.3)
    g = (jnp.array(0.4), jnp.array(-0.9))  # grad_mu E_q[loss], held fixed (a linearised loss)

    def lam_of(eta):
        return Gamma.to_natural(eta[0], eta[0] * eta[1])

    def loss(eta):  # L = g . mu - H(q)
        lam = lam_of(eta)
        mu = Gamma.expectation(lam)
        aa, bb = Gamma.from_natural(lam)
        return g[0] * mu.mu1 + g[1] * mu.mu2 - Gamma.entropy(aa, bb)

    @jax.jit
    def compute(a, b):
        eta = jnp.array([a, b / a])
        jac = jax.jacobian(lambda e: jnp.stack(lam_of(e)))(eta)
        hess_a = jax.hessian(lambda l: Gamma.log_partition(Gamma.Natural(l[0], l[1])))(jnp.stack(Gamma.to_natural(a, b)))
        fisher = jac.T @ hess_a @ jac
        direction = -jnp.linalg.solve(fisher, jax.grad(loss)(eta))
        lr = 1e-6
        a_new, b_new = Gamma.from_natural(Gamma.blr_update(Gamma.to_natural(a, b), Gamma.Expectation(*g), lr))
        return fisher, direction, (jnp.array([a_new, b_new / a_new]) - eta) / lr

    fisher, direction, step = compute(a, b)
    close(fisher[0, 1], 0.0, atol=1e-12)  # diagonal in (a, b/a)
    close(step, direction, rtol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_statistics_and_numpyro_distribution(name):
    """log q(x) = lam . T(x) - A(lam) (base measure 1); ``to_numpyro`` is NumPyro's distribution of the
    same q, and ``from_numpyro`` reads the user parameters back."""
    fam, user, ref, x = cases()[name]
    lam = fam.to_natural(*user)
    t = fam.sufficient_statistics(x, *([user[0].shape[-1]] if name == "categorical" else []))
    close(sum(jnp.sum(l * s) for l, s in zip(lam, t)) - fam.log_partition(lam), fam.log_prob(x, *user), rtol=1e-10)
    d = fam.to_numpyro(*user)
    assert type(d) is type(ref)
    close(jnp.sum(d.log_prob(x)), fam.log_prob(x, *user), rtol=1e-12)
    back = fam.from_numpyro(ref)
    tree_close(back if isinstance(back, tuple) else (back,), user, rtol=1e-12)


@pytest.mark.slow
def test_full_gaussian_statistics_and_blr_update():
    """The dense Gaussian (conjugate_fit's family): log q = lam . T - A; the plain step is exactly
    -grad_mu at lr = 1; the improved step keeps the plain fixed point, keeps the precision positive
    definite for a gradient that makes the plain step indefinite, and its precision is
    S + lr G + lr^2/2 G S^-1 G (G = 2 grad_mu2 - S, Lin, Schmidt & Khan 2020)."""
    rng = np.random.default_rng(3)
    a = rng.normal(size=(3, 3))
    mean, precision, x = jnp.asarray(rng.normal(size=3)), jnp.asarray(a @ a.T + np.eye(3)), jnp.asarray(rng.normal(size=3))
    lam = FullGaussian.to_natural(mean, precision)
    t = FullGaussian.sufficient_statistics(x)
    close(lam.eta1 @ t.mu1 + jnp.sum(lam.eta2 * t.mu2) - FullGaussian.log_partition(lam), FullGaussian.log_prob(x, mean, precision))
    tree_close(FullGaussian.from_numpyro(FullGaussian.to_numpyro(mean, precision)), (mean, precision), rtol=1e-12)
    target = FullGaussian.to_natural(mean + 1.0, 2.0 * precision)
    grad_mu = FullGaussian.Expectation(-target.eta1, -target.eta2)
    for got, want in zip(FullGaussian.blr_update(lam, grad_mu, 1.0, improved=False), target):
        np.testing.assert_array_equal(got, want)
    tree_close(FullGaussian.blr_update(target, grad_mu, 0.7, improved=True), target, rtol=1e-12, atol=1e-12)
    bad = FullGaussian.Expectation(jnp.ones(3), -5.0 * jnp.eye(3))  # E[hessian] = -10 I
    assert not bool(FullGaussian.is_valid(FullGaussian.blr_update(lam, bad, 0.5, improved=False)))
    new = FullGaussian.blr_update(lam, bad, 0.5, improved=True)
    assert bool(FullGaussian.is_valid(new))
    g = 2.0 * bad.mu2 - precision
    close(-2.0 * new.eta2, precision + 0.5 * g + 0.125 * g @ jnp.linalg.solve(precision, g), rtol=1e-10)


def test_registry():
    """One row per family: guide parameters with a constraint each; which family a support gets
    (ExpFamilyGuide) and which family a prior belongs to (conjugate_fit)."""
    from numpyro.distributions import constraints as c

    for info in FAMILIES.values():
        assert len(info.params) == len(info.constraints)
        assert info.discrete == (info.name in ("bernoulli", "categorical"))
    supports = [  # (support, default family, allowed families)
        (c.real, "normal", ("normal",)), (c.real_vector, "normal", ("normal",)), (c.positive, "gamma", ("gamma", "normal")),
        (c.unit_interval, "beta", ("beta", "normal")), (c.simplex, "dirichlet", ("dirichlet", "normal")),
        (c.boolean, "bernoulli", ("bernoulli", "categorical")), (c.integer_interval(0, 3), "categorical", ("categorical",)),
        (c.interval(2.0, 5.0), None, ("normal",)), (c.nonnegative, None, ("normal",)), (c.nonnegative_integer, None, ()),
    ]
    for support, default, allowed in supports:
        assert (default_family(support), allowed_families(support)) == (default, allowed), support
    priors = {
        dist.Normal(0.0, 1.0): "multivariate_normal", dist.MultivariateNormal(jnp.zeros(2), jnp.eye(2)): "multivariate_normal",
        dist.Gamma(2.0, 1.0): "gamma", dist.Exponential(1.0): "gamma", dist.Beta(1.0, 2.0): "beta",
        dist.Dirichlet(jnp.ones(3)): "dirichlet", dist.Bernoulli(0.3): "bernoulli", dist.Bernoulli(logits=0.3): "bernoulli",
        dist.Categorical(jnp.ones(3) / 3): "categorical", dist.Categorical(logits=jnp.zeros(3)): "categorical",
    }
    for d, name in priors.items():
        assert for_prior(d).name == name
    assert for_prior(dist.LogNormal(0.0, 1.0)) is None
    assert prior_names() == "Normal, MultivariateNormal, Gamma, Exponential, Beta, Dirichlet, Bernoulli, Categorical"


# hypothesis: adversarial gradients and steps
positive = st.floats(1e-3, 1e3)
grads = st.floats(-1e6, 1e6, allow_nan=False)
steps = st.floats(1e-4, 1e2)
hyp = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

_gamma_update = jax.jit(Gamma.blr_update)
_beta_update = jax.jit(Beta.blr_update)
_dirichlet_update = jax.jit(Dirichlet.blr_update)
_bernoulli_update = jax.jit(Bernoulli.blr_update)
_categorical_update = jax.jit(Categorical.blr_update)


@hyp
@given(positive, positive, grads, grads, steps)
def test_gamma_improved_update_stays_valid(a, b, g1, g2, lr):
    new = _gamma_update(Gamma.to_natural(jnp.array(a), jnp.array(b)), Gamma.Expectation(jnp.array(g1), jnp.array(g2)), lr)
    assert bool(Gamma.is_valid(new))
    a_new, _ = Gamma.from_natural(new)
    assert a_new >= a / 2 * (1 - 1e-12)  # a_new >= a/2 + (a + lr d)^2 / (2a)


@hyp
@given(positive, positive, grads, grads, steps)
def test_beta_improved_update_stays_valid(a, b, g1, g2, lr):
    new = _beta_update(Beta.to_natural(jnp.array(a), jnp.array(b)), Beta.Expectation(jnp.array(g1), jnp.array(g2)), lr)
    assert bool(Beta.is_valid(new))
    a_new, b_new = Beta.from_natural(new)
    assert a_new >= a / 2 * (1 - 1e-12) and b_new >= b / 2 * (1 - 1e-12)


@hyp
@given(st.lists(positive, min_size=3, max_size=3), st.lists(grads, min_size=3, max_size=3), steps)
def test_dirichlet_improved_update_stays_valid(alpha, g, lr):
    alpha = jnp.array(alpha)
    new = _dirichlet_update(Dirichlet.to_natural(alpha), Dirichlet.Expectation(jnp.array(g)), lr)
    assert bool(Dirichlet.is_valid(new))
    assert jnp.all(Dirichlet.from_natural(new) >= alpha / 2 * (1 - 1e-12))



_trusted = {
    "beta": jax.jit(lambda a, b, g1, g2, lr: Beta.from_natural(Beta.blr_update(
        Beta.to_natural(a, b), Beta.Expectation(g1, g2), lr, max_step=1.0))),
    "gamma": jax.jit(lambda a, b, g1, g2, lr: Gamma.from_natural(Gamma.blr_update(
        Gamma.to_natural(a, b), Gamma.Expectation(g1, g2), lr, max_step=1.0))),
}


@hyp
@given(positive, positive, grads, grads, steps)
def test_trusted_step_bounds_the_relative_change(a, b, g1, g2, lr):
    """With ``max_step=1`` each positive parameter of the improved step stays in [theta/2, 5 theta/2]
    (for the Gamma: the shape a and the inverse mean r = b / a, so b within [a r / 4, 25 a r / 4])."""
    a, b, g1, g2 = (jnp.array(v) for v in (a, b, g1, g2))
    a_new, b_new = _trusted["beta"](a, b, g1, g2, lr)
    for old, new in ((a, a_new), (b, b_new)):
        assert old / 2 * (1 - 1e-9) <= new <= 2.5 * old * (1 + 1e-9)
    a_new, b_new = _trusted["gamma"](a, b, g1, g2, lr)
    assert bool(jnp.isfinite(a_new) & jnp.isfinite(b_new))
    r, r_new = b / a, b_new / a_new
    assert r / 2 * (1 - 1e-9) <= r_new <= 2.5 * r * (1 + 1e-9)
    alpha = jnp.stack([a, b, a + b])
    new = Dirichlet.from_natural(_dirichlet_trusted(Dirichlet.to_natural(alpha), Dirichlet.Expectation(jnp.stack([g1, g2, g1 - g2])), lr))
    assert jnp.all(new >= alpha / 2 * (1 - 1e-9)) and jnp.all(new <= 2.5 * alpha * (1 + 1e-9))


_dirichlet_trusted = jax.jit(lambda lam, g, lr: Dirichlet.blr_update(lam, g, lr, max_step=1.0))


@pytest.mark.parametrize("name", ["gamma", "beta", "dirichlet"])
def test_trusted_step_keeps_the_fixed_point_and_small_steps(name):
    """The trust region changes neither the fixed point nor a step that is already inside it."""
    fam, user, _, _ = cases()[name]
    target = valid_target(name, fam, user)
    grad_mu = fam.Expectation(*[-t for t in target])
    tree_close(fam.blr_update(target, grad_mu, 0.7, max_step=1.0), target, rtol=1e-12, atol=1e-12)
    lam = fam.to_natural(*user)
    tree_close(fam.blr_update(lam, grad_mu, 1e-4, max_step=1.0), fam.blr_update(lam, grad_mu, 1e-4), rtol=1e-14)

@hyp
@given(st.floats(-50, 50), grads, st.lists(grads, min_size=2, max_size=2), steps)
def test_logit_families_stay_finite(logit, g, gc, lr):
    assert bool(Bernoulli.is_valid(_bernoulli_update(Bernoulli.to_natural(jnp.array(logit)), Bernoulli.Expectation(jnp.array(g)), lr)))
    new = _categorical_update(Categorical.to_natural(jnp.array([logit, 0.0, 1.0])), Categorical.Expectation(jnp.array(gc)), lr)
    assert bool(Categorical.is_valid(new))


def test_plain_update_can_leave_the_domain():
    """Why the improved step exists: the plain BLR step goes negative for a bad gradient."""
    lam = Gamma.to_natural(jnp.array(2.0), jnp.array(1.0))
    bad = Gamma.Expectation(jnp.array(50.0), jnp.array(-50.0))
    assert not bool(Gamma.is_valid(Gamma.blr_update(lam, bad, 0.5, improved=False)))
    assert bool(Gamma.is_valid(Gamma.blr_update(lam, bad, 0.5, improved=True)))


@pytest.mark.slow
def test_quadrature_rules_are_exact_for_the_statistics():
    """Each family's quadrature rule (message passing's expectations): sum_j w_j T(x_j) = mu, and autodiff through
    the rule gives grad_mu of E_q[c . T(x)] = c exactly (float64), also far from the defaults (large shapes)."""
    with jax.enable_x64(True):
        rng = np.random.default_rng(0)
        a = rng.normal(size=(3, 4, 4))
        cases = [
            (FullGaussian, FullGaussian.to_natural(jnp.asarray(rng.normal(size=(3, 4))), jnp.asarray(a @ a.transpose(0, 2, 1) + np.eye(4)))),
            (Gamma, Gamma.to_natural(jnp.array([0.3, 5.0, 1e6]), jnp.array([2.0, 1.0, 3.0]))),
            (Beta, Beta.to_natural(jnp.array([1.0, 0.1, 100.0]), jnp.array([1.0, 0.1, 1.0]))),
            (Dirichlet, Dirichlet.to_natural(jnp.array([[0.1, 2.0, 30.0, 1e-2], [500.0, 500.0, 500.0, 500.0]]))),
            (Bernoulli, Bernoulli.to_natural(jnp.array([-3.0, 0.0, 20.0]))),
            (Categorical, Categorical.to_natural(jnp.array([[0.0, 1.0, -2.0], [5.0, 0.0, 0.0]]))),
        ]
        for fam, nat in cases:
            mu = fam.expectation(nat)
            coef = fam.Expectation(*[jnp.asarray(rng.normal(size=m.shape)) for m in mu])
            if fam is FullGaussian:  # E[x x^T] is symmetric: only the symmetric part of its coefficient is seen
                coef = coef._replace(mu2=0.5 * (coef.mu2 + jnp.swapaxes(coef.mu2, -1, -2)))

            def expected(m, fam=fam, nat=nat, coef=coef):
                points, w = fam.quadrature(fam.Expectation(*m), nat)
                if fam is Categorical:
                    stats = fam.sufficient_statistics(points, 3)
                else:
                    stats = fam.sufficient_statistics(points)
                means = [jnp.sum(w.reshape(w.shape + (1,) * (t.ndim - w.ndim)) * t, 0) for t in stats]
                return sum(jnp.sum(c * m) for c, m in zip(coef, means)), means

            (value, means), grad = jax.value_and_grad(expected, has_aux=True)(tuple(mu))
            for got, want in zip(means, mu):
                np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
            for got, want in zip(grad, coef):
                np.testing.assert_allclose(got, want, rtol=1e-7, atol=1e-9)

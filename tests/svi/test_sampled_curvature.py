"""nb.BLR()'s curvature above 256 latent numbers (``hessian="hutchinson"``): Hutchinson's diagonal with one whitened
Rademacher probe per block, the sample's offset read off the gradients, and the control variate
:math:`\\nabla^2\\ell(m)(z - m)` of the mean gradient (numpyro_blr.estimators.svi)."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.infer import SVI, Trace_ELBO, TraceMeanField_ELBO
from numpyro.infer.autoguide import AutoDiagonalNormal, AutoNormal
from numpyro.infer.svi import _make_loss_fn

import numpyro_blr as nb
from numpyro_blr.estimators import estimate
from numpyro_blr.estimators.svi import reads_sample_offsets
from numpyro_blr.layout import read_layout

GROUPS, PER_GROUP = 300, 4


def grouped_model(group, y=None):
    """y ~ N(mu + a[group], 1), a ~ N(0, 1), mu ~ N(0, 10): a Gaussian posterior of 301 numbers, every group's
    coordinate coupled to mu (a star), none to another group's."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    with numpyro.plate("groups", GROUPS):
        a = numpyro.sample("a", dist.Normal(0.0, 1.0))
    with numpyro.plate("data", group.shape[0]):
        numpyro.sample("y", dist.Normal(mu + a[group], 1.0), obs=y)


@pytest.fixture(scope="module")
def grouped():
    """The data and the posterior's precision P, mean and mean-field optimum (mean: the posterior's; sds
    1/sqrt(diag P)), coordinates [mu, a_1, ..., a_G]."""
    rng = np.random.default_rng(0)
    group = np.repeat(np.arange(GROUPS), PER_GROUP)
    y = 3.0 + rng.normal(size=GROUPS)[group] + rng.normal(size=group.size)
    jac = np.zeros((group.size, GROUPS + 1))
    jac[:, 0] = 1.0
    jac[np.arange(group.size), 1 + group] = 1.0
    precision = jac.T @ jac + np.diag([1e-2] + [1.0] * GROUPS)
    mean = np.linalg.solve(precision, jac.T @ y)
    return (group, y), precision, mean, 1.0 / np.sqrt(np.diag(precision))


def _loss_and_params(model, args, loss=None, params=None):
    """SVI's loss function (its draw fixed by the key) and unconstrained guide parameters."""
    args = tuple(jnp.asarray(a) for a in args)
    guide = AutoNormal(model)
    svi = SVI(model, guide, nb.BLR(), loss or Trace_ELBO())
    state = svi.init(jax.random.PRNGKey(0), *args)
    raw = svi.optim.get_params(state.optim_state)
    if params is not None:
        raw = {**raw, **params}

    def make(key):
        return _make_loss_fn(loss or Trace_ELBO(), key, svi.constrain_fn, model, guide, args, {}, {})

    return make, raw, read_layout(raw)


@pytest.mark.slow
def test_hutchinson_probe_per_block_is_exact_where_blocks_hold_uncoupled_coordinates(grouped):
    """With a probe of its own, a scalar block (mu) gets the exact curvature, and so does a block whose coordinates
    are coupled to none other of the block (the groups): the 300 couplings to mu do not enter."""
    args, precision, _, _ = grouped
    with jax.enable_x64(True):
        make, raw, layout = _loss_and_params(grouped_model, args)
        probe = jax.jit(lambda k: estimate(make(k), raw, layout, "hutchinson", key=jax.random.fold_in(k, 1))[2])
        for k in range(3):
            stats = probe(jax.random.PRNGKey(k))
            np.testing.assert_allclose(stats["mu_auto_loc"].h, precision[0, 0], rtol=1e-12)
            np.testing.assert_allclose(stats["a_auto_loc"].h, np.diag(precision)[1:], rtol=1e-12)


@pytest.mark.slow  # a BLR fit (its compilation) besides the estimate's
def test_autodiagonalnormal_gets_a_probe_per_site(grouped):
    """AutoDiagonalNormal packs mu and the 300 groups into one vector: the probes follow its sites
    (``GaussianBlock.segments``), so its estimate is AutoNormal's, exact here, and its fit reaches the mean-field
    optimum as AutoNormal's does. Before, one probe over the vector gave mu the noise of its coupling to every group
    (its sd 1.08x the optimum's after 300 steps)."""
    (group, y), precision, mean, sd = grouped
    with jax.enable_x64(True):
        args = (jnp.asarray(group), jnp.asarray(y))
        guide = AutoDiagonalNormal(grouped_model)
        svi = SVI(grouped_model, guide, nb.BLR(), Trace_ELBO())
        state = svi.init(jax.random.PRNGKey(0), *args)
        raw = svi.optim.get_params(state.optim_state)
        layout = svi.optim.layout(raw)
        assert layout.blocks[0].segments == (1, GROUPS)

        def make(key):
            return _make_loss_fn(Trace_ELBO(), key, svi.constrain_fn, grouped_model, guide, args, {}, {})

        probe = jax.jit(lambda k: estimate(make(k), raw, layout, "hutchinson", key=jax.random.fold_in(k, 1))[2])
        for k in range(3):
            np.testing.assert_allclose(probe(jax.random.PRNGKey(k))["auto_loc"].h, np.diag(precision), rtol=1e-12)
        result = nb.fit(grouped_model, AutoDiagonalNormal(grouped_model), *args, num_steps=300, progress_bar=False)
    assert np.max(np.abs(np.asarray(result.params["auto_loc"]) - mean) / sd) < 1e-3
    np.testing.assert_allclose(np.asarray(result.params["auto_scale"]), sd, rtol=1e-3)


def test_hutchinson_probes_average_to_the_hessian_diagonal():
    """A block of coupled coordinates: over all 2^3 sign vectors the estimate averages to the exact diagonal."""
    from numpyro_blr.estimators.svi import hutchinson_diagonal

    h = np.array([[4.0, 1.5, -0.7], [1.5, 2.0, 0.3], [-0.7, 0.3, 1.0]])
    scale = np.array([0.5, 0.7, 1.0])
    signs = np.array(np.meshgrid(*[[-1.0, 1.0]] * 3)).reshape(3, -1).T
    draws = [hutchinson_diagonal(scale, v, h @ (scale * v)) for v in signs]
    np.testing.assert_allclose(np.mean(draws, 0), np.diag(h), rtol=1e-12)
    assert np.std(draws, 0).max() > 0.1  # a single probe is not exact here


def logistic_model(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 2.0))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w + b), obs=y)


@pytest.mark.slow
def test_sample_offset_read_off_the_gradients_is_the_draws_offset():
    """z - m from the mean's and the scale's gradients equals the exact Hessian's solve for it (a logistic model,
    so no quadratic shortcut), for every draw."""
    rng = np.random.default_rng(1)
    X = rng.normal(size=(80, 3))
    y = (rng.random(80) < 1 / (1 + np.exp(-(X @ np.array([1.0, -0.5, 0.2]))))).astype(np.float64)
    for x64 in (True, False):
        with jax.enable_x64(x64):
            make, raw, layout = _loss_and_params(logistic_model, (X, y), params={"w_auto_loc": jnp.array([0.8, -0.3, 0.1])})
            # the quotient's rounding: sqrt(eps) where |s grad| is near its threshold, far less elsewhere
            tol = 10 * np.sqrt(np.finfo(raw["w_auto_loc"].dtype).eps)

            @jax.jit
            def stats(key):  # the three estimates of one draw (the loss's key)
                fn = make(key)
                return (estimate(fn, raw, layout, "autodiff")[2],
                        estimate(fn, raw, layout, "hutchinson", key=jax.random.PRNGKey(0), sample_offsets=True)[2],
                        estimate(fn, raw, layout, "reparam", sample_offsets=True)[2])

            for k in range(4):
                exact, read, price = stats(jax.random.PRNGKey(k))
                for n in ("w_auto_loc", "b_auto_loc"):
                    np.testing.assert_allclose(read[n].offset, exact[n].offset, rtol=tol, atol=tol)
                    assert read[n].control is not None
                    # Price's estimators keep their published one-pass form (nb.von(), the deep-learning rows)
                    assert price[n].control is None and price[n].offset is None


@pytest.mark.slow
def test_sample_offsets_only_for_one_draw_of_a_trace_elbo(grouped):
    """The offset is read off the gradients of one draw's log-density: not with K particles (their gradients are
    averages) nor with TraceMeanField_ELBO (the KL of a site with a closed form enters the gradients)."""
    args = grouped[0]
    for elbo, expected in ((Trace_ELBO(), True), (Trace_ELBO(num_particles=2), False), (TraceMeanField_ELBO(), False)):
        make, _, _ = _loss_and_params(grouped_model, args, loss=elbo)
        assert reads_sample_offsets(make(jax.random.PRNGKey(0))) is expected, type(elbo).__name__
    assert reads_sample_offsets(lambda p: (0.0, None))  # a loss written by hand is taken as one draw


@pytest.mark.parametrize("x64", [True, False], ids=["float64", "float32"])
@pytest.mark.slow
def test_default_above_256_numbers_reaches_the_mean_field_optimum(grouped, x64):
    """301 numbers: the default estimates the curvature with Hutchinson's probes. On this Gaussian posterior the
    estimate is exact and the control variate removes the draws' noise from the mean gradient, so 300 steps end at
    the mean-field optimum to rounding. Price's estimate without these (the default before) ended 0.24 sd off, its
    sds 0.87-1.31x, with no warning."""
    (group, y), _, mean, sd = grouped
    with jax.enable_x64(x64):
        args = (jnp.asarray(group), jnp.asarray(y))
        guide = AutoNormal(grouped_model)
        optim = nb.BLR()
        result = nb.fit(grouped_model, guide, *args, optim=optim, num_steps=300, progress_bar=False)
        p = result.params
        got_mean = np.concatenate([[float(p["mu_auto_loc"])], np.asarray(p["a_auto_loc"])])
        got_sd = np.concatenate([[float(p["mu_auto_scale"])], np.asarray(p["a_auto_scale"])])
        _, raw, layout = _loss_and_params(grouped_model, args)
        assert optim.hessian_for(raw, layout) == "hutchinson"
    tol = 1e-3 if x64 else 1e-2  # float32: the loss's rounding (about 1e3 nats at eps 1.2e-7) moves the means
    assert np.max(np.abs(got_mean - mean) / sd) < tol
    np.testing.assert_allclose(got_sd, sd, rtol=tol)


def test_default_estimator_by_size_and_family():
    """The exact Hessian up to 256 numbers, and up to 1,024 for a guide of full-covariance blocks only (its step is
    O(D^3) anyway; the sampled full estimate was 528-685 nats short after 1,000 steps at D = 304-404); Hutchinson's
    diagonal above, and for mean-field guides above 256. (The guides' parameters as NumPyro's autoguides name them.)"""

    def resolved(params):
        return nb.BLR().hessian_for(params, read_layout(params))

    def mean_field(d):
        return {"a_auto_loc": np.zeros(d - 1), "a_auto_scale": np.ones(d - 1), "mu_auto_loc": np.zeros(()),
                "mu_auto_scale": np.ones(())}

    def full(d):
        return {"auto_loc": np.zeros(d), "auto_scale_tril": np.zeros(d * (d + 1) // 2)}  # unconstrained, as SVI holds it

    assert resolved(mean_field(256)) == "autodiff" and resolved(mean_field(257)) == "hutchinson"
    assert resolved(full(1024)) == "autodiff" and resolved(full(1025)) == "hutchinson"

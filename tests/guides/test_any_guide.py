"""nb.BLR with guides other than the autoguides: hand-written guides, non-Gaussian guides through the
fallback, pytree parameters, numpyro.contrib.module placeholders, a state from another optimizer."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest
from numpyro.distributions import constraints
from numpyro.infer import SVI, Trace_ELBO
from numpyro.infer.autoguide import AutoNormal

import numpyro_blr as nb

# svi.run here starts from svi.init's default compiled program (tests/conftest.py runs NumPyro's eager start elsewhere)
pytestmark = pytest.mark.compiled_init

N, D = 60, 3
_rng = np.random.default_rng(11)
X = jnp.asarray(_rng.normal(size=(N, D)), jnp.float32)
Y = X @ jnp.array([1.0, -2.0, 0.5]) + jnp.asarray(_rng.normal(size=N), jnp.float32)


def model(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    numpyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)


def exact_posterior():
    """Conjugate linear regression: prior N(0, I), noise sd 1 (float64)."""
    Xd, yd = np.asarray(X, float), np.asarray(Y, float)
    prec = Xd.T @ Xd + np.eye(D)
    cov = np.linalg.inv(prec)
    return cov @ Xd.T @ yd, cov, prec


def normal_guide(X, y=None):
    loc = numpyro.param("w_loc", jnp.zeros(X.shape[1]))
    scale = numpyro.param("w_scale", jnp.ones(X.shape[1]), constraint=constraints.positive)
    numpyro.sample("w", dist.Normal(loc, scale).to_event(1))


def mvn_guide(X, y=None, constraint=constraints.lower_cholesky):
    loc = numpyro.param("m", jnp.zeros(X.shape[1]))
    tril = numpyro.param("L", jnp.eye(X.shape[1]), constraint=constraint)
    numpyro.sample("w", dist.MultivariateNormal(loc, scale_tril=tril))


# ---------------------------------------------------------------- item 1: hand-written guides


@pytest.mark.slow
def test_hand_written_normal_guide_reaches_the_exact_mean_field_posterior():
    mean, _, prec = exact_posterior()
    opt = nb.BLR(guide=normal_guide, guide_args=(X,))
    result = SVI(model, normal_guide, opt, Trace_ELBO()).run(jax.random.PRNGKey(0), 100, X, Y, progress_bar=False)
    # the mean-field optimum on a Gaussian posterior: the exact mean, sd = 1/sqrt(diag(precision))
    np.testing.assert_allclose(result.params["w_loc"], mean, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(result.params["w_scale"], 1 / np.sqrt(np.diag(prec)), rtol=1e-4)
    (block,) = opt.layout({"w_loc": jnp.zeros(D), "w_scale": jnp.zeros(D)}).blocks
    assert (block.kind, block.loc, block.scale) == ("diagonal", "w_loc", "w_scale")
    assert block.scale_constraint is constraints.positive  # an exp transform, read from the guide


@pytest.mark.slow
@pytest.mark.parametrize("constraint", [constraints.lower_cholesky, constraints.scaled_unit_lower_cholesky])
def test_hand_written_multivariate_normal_guide_reaches_the_exact_posterior(constraint):
    mean, cov, _ = exact_posterior()

    def guide(X, y=None):
        mvn_guide(X, y, constraint)

    result = SVI(model, guide, nb.BLR(guide=guide, guide_args=(X,)), Trace_ELBO()).run(
        jax.random.PRNGKey(0), 100, X, Y, progress_bar=False
    )
    np.testing.assert_allclose(result.params["m"], mean, rtol=1e-4, atol=1e-4)
    tril = np.asarray(result.params["L"], float)
    np.testing.assert_allclose(tril @ tril.T, cov, rtol=1e-3, atol=1e-6)


@pytest.mark.slow
def test_hand_written_guide_without_arguments_and_lognormal_site():
    """A guide that takes no arguments is traced as it is; a LogNormal site is a Gaussian on log(x)."""
    data = jnp.asarray(np.random.default_rng(0).normal(0.0, 2.0, size=40), jnp.float32)

    def scale_model(y=None):
        sigma = numpyro.sample("sigma", dist.LogNormal(0.0, 1.0))
        numpyro.sample("y", dist.Normal(0.0, sigma), obs=y)

    def guide(y=None):
        loc = numpyro.param("log_sigma_loc", 0.0)
        scale = numpyro.param("log_sigma_scale", 1.0, constraint=constraints.softplus_positive)
        numpyro.sample("sigma", dist.LogNormal(loc, scale))

    opt = nb.BLR(guide=guide)
    result = SVI(scale_model, guide, opt, Trace_ELBO(num_particles=8)).run(
        jax.random.PRNGKey(0), 400, data, progress_bar=False
    )
    # posterior of log sigma: close to Gaussian around log(sd of the data)
    assert abs(float(result.params["log_sigma_loc"]) - np.log(np.sqrt(np.mean(np.asarray(data) ** 2)))) < 0.1
    assert 0.05 < float(result.params["log_sigma_scale"]) < 0.2  # about 1/sqrt(2n) = 0.11


def test_hand_written_guide_without_guide_argument_names_the_fix():
    """Outside SVI and nb.fit (which pass their guide, below) the optimizer sees only parameter names."""
    with pytest.raises(nb.GuideLayoutError, match=r"(?s)'w_loc', 'w_scale'.*guide=guide"):
        nb.BLR().init({"w_loc": jnp.zeros(D), "w_scale": jnp.ones(D)})


@pytest.mark.slow
def test_svi_hands_its_guide_to_the_optimizer():
    """SVI(model, guide, nb.BLR(), ...) reads a hand-written guide (traced with svi.init's arguments) and an
    autoguide's own prefix, with no nb.BLR(guide=...); the user's optimizer object is left as it was."""
    opt = nb.BLR()
    svi = SVI(model, normal_guide, opt, Trace_ELBO())
    svi.init(jax.random.PRNGKey(0), X, Y)
    (block,) = svi.optim.layout({"w_loc": jnp.zeros(D), "w_scale": jnp.ones(D)}).blocks
    assert (block.kind, block.loc, block.scale) == ("diagonal", "w_loc", "w_scale")
    assert block.scale_constraint is constraints.positive
    assert opt.guide is None and svi.optim is not opt  # a copy reads the guide: opt can serve another SVI

    other = SVI(model, mvn_guide, opt, Trace_ELBO())
    state = other.init(jax.random.PRNGKey(0), X, Y)
    (block,) = other.optim.layout(state.optim_state[1].params).blocks  # unconstrained: L as its D(D+1)/2 entries
    assert (block.kind, block.loc, block.scale) == ("full", "m", "L")

    guide = AutoNormal(model, prefix="q")
    svi = SVI(model, guide, opt, Trace_ELBO())
    svi.init(jax.random.PRNGKey(0), X, Y)
    (block,) = svi.optim.layout({"w_q_loc": jnp.zeros(D), "w_q_scale": jnp.ones(D)}).blocks
    assert (block.loc, block.scale) == ("w_q_loc", "w_q_scale")
    assert SVI(model, AutoNormal(model), opt, Trace_ELBO()).optim is opt  # the default prefix: read by the names


@pytest.mark.slow
def test_hand_written_guides_without_guide_argument_reach_the_exact_posterior():
    """The same nb.BLR() object for a mean-field and a full-covariance hand-written guide, by svi.run and nb.fit."""
    mean, cov, prec = exact_posterior()
    opt = nb.BLR()
    svi = SVI(model, normal_guide, opt, Trace_ELBO())
    result = svi.run(jax.random.PRNGKey(0), 100, X, Y, progress_bar=False)
    np.testing.assert_allclose(result.params["w_loc"], mean, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(result.params["w_scale"], 1 / np.sqrt(np.diag(prec)), rtol=1e-4)
    # the report reads the guide's blocks through the optimizer the fit ran with; without it, it says what it skipped
    assert nb.fit_report(result, svi.optim).unread is None
    assert "not checked" in str(nb.fit_report(result)) and "svi.optim" in nb.fit_report(result).unread
    for res in (SVI(model, mvn_guide, opt, Trace_ELBO()).run(jax.random.PRNGKey(0), 100, X, Y, progress_bar=False),
                nb.fit(model, mvn_guide, X, Y, optim=opt, num_steps=100, progress_bar=False)):
        np.testing.assert_allclose(res.params["m"], mean, rtol=1e-4, atol=1e-4)
        tril = np.asarray(res.params["L"], float)
        np.testing.assert_allclose(tril @ tril.T, cov, rtol=1e-3, atol=1e-6)


def test_guide_that_needs_arguments_asks_for_them():
    with pytest.raises(nb.GuideLayoutError, match="guide_args"):
        nb.BLR(guide=normal_guide)

    def needs_data(*args):  # binds without arguments, but fails when called without them
        normal_guide(*args)

    svi = SVI(model, needs_data, nb.BLR(guide=needs_data), Trace_ELBO())
    with pytest.raises(nb.GuideLayoutError, match=r"calling it with guide_args=\(\).*failed"):
        svi.init(jax.random.PRNGKey(0), X, Y)


@pytest.mark.slow
def test_autoguide_names_with_another_scale_constraint_are_not_silently_misread():
    """Names like AutoNormal's but an unconstrained scale: this once ran and stayed at the prior, then raised
    (read by the names) unless given guide=...; now SVI hands its guide over and it is read by tracing."""

    def lookalike(X, y=None):
        loc = numpyro.param("w_auto_loc", jnp.zeros(X.shape[1]))
        scale = numpyro.param("w_auto_scale", jnp.ones(X.shape[1]))  # no constraint
        numpyro.sample("w", dist.Normal(loc, scale).to_event(1))

    # a hand-written guide is read by tracing it (SVI hands it to the optimizer, as guide=... would): the
    # unconstrained scale is used as it is (BLR keeps it positive)
    mean, _, prec = exact_posterior()
    for opt in (nb.BLR(), nb.BLR(guide=lookalike, guide_args=(X,))):
        result = SVI(model, lookalike, opt, Trace_ELBO()).run(jax.random.PRNGKey(0), 100, X, Y, progress_bar=False)
        np.testing.assert_allclose(result.params["w_auto_loc"], mean, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(result.params["w_auto_scale"], 1 / np.sqrt(np.diag(prec)), rtol=1e-4)


def test_computed_scale_is_not_read_and_goes_to_the_fallback_or_is_named():
    def log_scale_guide(X, y=None):
        loc = numpyro.param("w_loc", jnp.zeros(X.shape[1]))
        log_scale = numpyro.param("w_log_scale", jnp.zeros(X.shape[1]))
        numpyro.sample("w", dist.Normal(loc, jnp.exp(log_scale)).to_event(1))

    with pytest.raises(nb.GuideLayoutError, match=r"(?s)'w_log_scale'.*site 'w': its scale is not"):
        SVI(model, log_scale_guide, nb.BLR(guide=log_scale_guide, guide_args=(X,)), Trace_ELBO()).init(
            jax.random.PRNGKey(0), X, Y
        )
    # with a fallback the whole guide is fitted by it (nothing is a Gaussian BLR can read)
    opt = nb.BLR(guide=log_scale_guide, guide_args=(X,), fallback=optax.adam(0.05))
    result = SVI(model, log_scale_guide, opt, Trace_ELBO()).run(jax.random.PRNGKey(0), 500, X, Y, progress_bar=False)
    mean, _, _ = exact_posterior()
    np.testing.assert_allclose(result.params["w_loc"], mean, atol=0.1)


# ---------------------------------------------------------------- item 2: the fallback


def beta_model(y=None):
    p = numpyro.sample("p", dist.Beta(1.0, 1.0))
    numpyro.sample("y", dist.Bernoulli(p), obs=y)


def beta_guide(y=None):
    a = numpyro.param("a", 1.0, constraint=constraints.positive)
    b = numpyro.param("b", 1.0, constraint=constraints.positive)
    numpyro.sample("p", dist.Beta(a, b))


COINS = jnp.array([1.0] * 14 + [0.0] * 6)


@pytest.mark.slow
@pytest.mark.parametrize("make", [lambda: optax.adam(0.05), lambda: numpyro.optim.Adam(0.05)], ids=["optax", "numpyro"])
def test_fallback_fits_a_guide_with_no_gaussian_exactly_as_it_alone_would(make):
    blr = SVI(beta_model, beta_guide, nb.BLR(fallback=make()), Trace_ELBO()).run(
        jax.random.PRNGKey(0), 300, COINS, progress_bar=False
    )
    alone = SVI(beta_model, beta_guide, make(), Trace_ELBO()).run(jax.random.PRNGKey(0), 300, COINS, progress_bar=False)
    for k in ("a", "b"):
        np.testing.assert_allclose(blr.params[k], alone.params[k], rtol=1e-5)
    mean = blr.params["a"] / (blr.params["a"] + blr.params["b"])
    assert abs(float(mean) - 15 / 22) < 0.05  # posterior Beta(15, 7)


@pytest.mark.slow
def test_flow_guide_is_fitted_by_the_fallback_as_by_it_alone():
    """A normalizing flow (its weights are '$params' pytrees the loss reads) has no Gaussian BLR can step."""
    from numpyro.infer.autoguide import AutoIAFNormal

    def run(optim):
        return SVI(model, AutoIAFNormal(model), optim, Trace_ELBO()).run(jax.random.PRNGKey(0), 60, X, Y, progress_bar=False)

    blr, alone = run(nb.BLR(fallback=optax.adam(0.01))), run(optax.adam(0.01))
    np.testing.assert_allclose(blr.losses, alone.losses, rtol=1e-5)
    assert np.mean(blr.losses[-10:]) < np.mean(blr.losses[:10])


@pytest.mark.slow
def test_hand_written_guide_with_a_gaussian_and_a_beta_site():
    """The Normal site is read by tracing and stepped by the BLR; the Beta site's parameters go to the fallback."""

    def joint_model(X, y=None, coins=None):
        model(X, y)
        p = numpyro.sample("p", dist.Beta(1.0, 1.0))
        numpyro.sample("coins", dist.Bernoulli(p), obs=coins)

    def joint_guide(X, y=None, coins=None):
        normal_guide(X, y)
        beta_guide(coins)

    opt = nb.BLR(guide=joint_guide, guide_args=(X,), fallback=optax.adam(0.05))
    result = SVI(joint_model, joint_guide, opt, Trace_ELBO()).run(
        jax.random.PRNGKey(0), 300, X, Y, COINS, progress_bar=False
    )
    (block,) = opt.layout(result.state.optim_state[1].params).blocks
    assert (block.loc, block.scale) == ("w_loc", "w_scale")
    mean, _, prec = exact_posterior()  # independent of the coin: the mean-field optimum is exact
    np.testing.assert_allclose(result.params["w_loc"], mean, rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(result.params["w_scale"], 1 / np.sqrt(np.diag(prec)), rtol=1e-3)
    assert abs(float(result.params["a"] / (result.params["a"] + result.params["b"])) - 15 / 22) < 0.05


def test_numpyro_optimizer_that_needs_the_loss_is_rejected_at_construction():
    with pytest.raises(ValueError, match="optax.adam"):
        nb.BLR(fallback=numpyro.optim.Minimize())
    with pytest.raises(ValueError, match="numpyro.optim.Adam"):
        nb.BLR(fallback="adam")


def _eqx_linear():
    import equinox as eqx

    return eqx.nn.Linear(D, 1, key=jax.random.PRNGKey(0))


@pytest.mark.slow
def test_fallback_updates_a_pytree_valued_parameter():
    """eqx_module registers the whole module's weights as one parameter (a pytree)."""
    from numpyro.contrib.module import eqx_module

    linear = _eqx_linear()

    def net_model(X, y=None):
        net = eqx_module("net", linear)
        noise = numpyro.sample("noise", dist.HalfNormal(1.0))
        numpyro.sample("y", dist.Normal(jax.vmap(net)(X)[:, 0], noise), obs=y)

    guide = AutoNormal(net_model)
    svi = SVI(net_model, guide, nb.BLR(fallback=optax.adam(0.05)), Trace_ELBO())
    result = svi.run(jax.random.PRNGKey(0), 300, X, Y, progress_bar=False)
    weight = np.ravel(result.params["net$params"].weight)
    assert np.all(np.isfinite(result.losses))
    np.testing.assert_allclose(weight, [1.0, -2.0, 0.5], atol=0.3)  # least squares fit of the data


# ---------------------------------------------------------------- item 3: numpyro.contrib.module placeholders


def _random_eqx_model(prior):
    from numpyro.contrib.module import random_eqx_module

    linear = _eqx_linear()

    def net_model(X, y=None):
        net = random_eqx_module("net", linear, prior=prior)
        numpyro.sample("y", dist.Normal(jax.vmap(net)(X)[:, 0], 1.0), obs=y)

    return net_model


@pytest.mark.slow
def test_unread_module_placeholder_is_passed_through():
    net_model = _random_eqx_model(dist.Normal(0.0, 1.0))
    svi = SVI(net_model, AutoNormal(net_model), nb.BLR(), Trace_ELBO())
    state0 = svi.init(jax.random.PRNGKey(0), X, Y)
    placeholder = svi.get_params(state0)["net$params"]
    result = svi.run(jax.random.PRNGKey(0), 100, X, Y, progress_bar=False)
    for a, b in zip(jax.tree.leaves(result.params["net$params"]), jax.tree.leaves(placeholder)):
        np.testing.assert_array_equal(a, b)
    # the Gaussian part is the conjugate posterior of the weight (the bias has a N(0, 1) prior too)
    Xb = np.hstack([np.asarray(X, float), np.ones((N, 1))])
    prec = Xb.T @ Xb + np.eye(D + 1)
    mean = np.linalg.solve(prec, Xb.T @ np.asarray(Y, float))
    np.testing.assert_allclose(np.ravel(result.params["net/weight_auto_loc"]), mean[:D], atol=1e-3)


@pytest.mark.slow
def test_read_module_placeholder_needs_fallback():
    net_model = _random_eqx_model({"weight": dist.Normal(0.0, 1.0)})  # the bias has no prior
    svi = SVI(net_model, AutoNormal(net_model), nb.BLR(), Trace_ELBO())
    state = svi.init(jax.random.PRNGKey(0), X, Y)
    with pytest.raises(nb.GuideLayoutError, match=r"net\$params.*fallback"):
        svi.update(state, X, Y)
    svi = SVI(net_model, AutoNormal(net_model), nb.BLR(fallback=optax.adam(0.05)), Trace_ELBO())
    result = svi.run(jax.random.PRNGKey(0), 200, X, Y, progress_bar=False)
    assert np.all(np.isfinite(result.losses))


# ---------------------------------------------------------------- item 5: a state from another optimizer


@pytest.mark.slow
def test_state_from_another_optimizer_says_how_to_start_from_its_params():
    adam = SVI(model, normal_guide, optax.adam(0.05), Trace_ELBO())
    adam_result = adam.run(jax.random.PRNGKey(0), 50, X, Y, progress_bar=False)
    blr = SVI(model, normal_guide, nb.BLR(guide=normal_guide, guide_args=(X,)), Trace_ELBO())
    for progress_bar in (False, True):
        with pytest.raises(TypeError, match=r"another optimizer.*init_params=previous_result.params"):
            blr.run(jax.random.PRNGKey(1), 5, X, Y, progress_bar=progress_bar, init_state=adam_result.state)
    # what the message says works: BLR starts from the Adam run's parameters
    state = blr.init(jax.random.PRNGKey(1), X, Y, init_params=adam_result.params)
    for k, v in blr.get_params(state).items():
        np.testing.assert_allclose(v, adam_result.params[k], rtol=1e-6)
    result = blr.run(jax.random.PRNGKey(1), 50, X, Y, progress_bar=False, init_params=adam_result.params)
    mean, _, _ = exact_posterior()
    np.testing.assert_allclose(result.params["w_loc"], mean, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_ivon_accepts_a_numpyro_optimizer_as_fallback():
    def with_param(X, y=None):
        noise = numpyro.param("noise", 0.5, constraint=constraints.positive)
        model_w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        numpyro.sample("y", dist.Normal(X @ model_w, noise), obs=y)

    optim = nb.IVON(lr=0.1, ess=N, fallback=numpyro.optim.Adam(0.05))
    result = SVI(with_param, AutoNormal(with_param), optim, Trace_ELBO()).run(
        jax.random.PRNGKey(0), 200, X, Y, progress_bar=False
    )
    assert np.all(np.isfinite(result.losses)) and abs(float(result.params["noise"]) - 0.5) > 0.1


@pytest.mark.parametrize("guide", [normal_guide, mvn_guide])
@pytest.mark.slow
def test_delta_method_moves_means_initialised_at_zero(guide):
    """nb.newton() from a guide initialised with jnp.zeros: a draw at the mean (scale eps**2) was not the mean
    there, the guide's log q cancelled the model's gradient, and the means stayed at 0 with no warning."""
    mean, cov, prec = exact_posterior()
    result = SVI(model, guide, nb.newton(), Trace_ELBO()).run(jax.random.PRNGKey(0), 2, X, Y, progress_bar=False)
    loc = result.params["w_loc" if guide is normal_guide else "m"]
    np.testing.assert_allclose(loc, mean, rtol=1e-4, atol=1e-4)  # Newton: exact on a quadratic loss
    if guide is mvn_guide:
        tril = np.asarray(result.params["L"], float)
        np.testing.assert_allclose(tril @ tril.T, cov, rtol=1e-3, atol=1e-6)
    else:  # the delta method's diagonal: the precision's diagonal
        np.testing.assert_allclose(result.params["w_scale"], 1 / np.sqrt(np.diag(prec)), rtol=1e-3)

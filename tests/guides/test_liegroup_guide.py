"""nb.LieGroupGuide + nb.LieGroupBLR() with their defaults (issue 25): the mean-field optimum without tuning, and a
fit that diverges, stalls or is too short says so."""

import math
import warnings

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.infer import SVI, Trace_ELBO
from numpyro.infer.autoguide import AutoNormal
from numpyro.infer.initialization import init_to_uniform

import numpyro_blr as nb


def _uncentred_regression(n=40, seed=0):
    """kidiq's geometry in small: an uncentred predictor (mean 100, sd 15), so intercept and slope have posterior
    correlation about -0.99, and an unknown noise scale."""
    rng = np.random.default_rng(seed)
    x = 100.0 + 15.0 * rng.standard_normal(n)
    y = 20.0 + 0.6 * x + 5.0 * rng.standard_normal(n)
    return x, y


def _model(x, y=None):
    beta = numpyro.sample("beta", dist.Normal(0.0, 100.0).expand([2]).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfNormal(20.0))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Normal(beta[0] + beta[1] * x, sigma), obs=y)


def _elbo(guide, params, x, y, n=4000):
    """ELBO and its Monte Carlo standard error, n draws from a fixed key (the same for every guide)."""
    losses = jax.vmap(lambda k: Trace_ELBO().loss(k, params, _model, guide, x, y))(jax.random.split(jax.random.PRNGKey(7), n))
    losses = np.asarray(losses, np.float64)
    return -losses.mean(), losses.std() / math.sqrt(n)


def _run(guide, optim, steps, x, y, key=0):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = SVI(_model, guide, optim, Trace_ELBO()).run(jax.random.PRNGKey(key), steps, x, y, progress_bar=False)
    return result, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


@pytest.mark.slow
def test_defaults_reach_the_mean_field_optimum():
    """LieGroupGuide + LieGroupBLR() (no lr) on an uncentred regression with unknown noise reaches the ELBO of
    nb.BLR() + AutoNormal (the mean-field Gaussian optimum) within 1 nat (the issue's target; the two ELBO estimates'
    Monte Carlo error, 4000 draws each, is added), and sigma's median is within 5% of that optimum's, with no
    warning. Before: LieGroupBLR had no default lr; with the documented lr=0.05 this fit ends ~1e4 nat short
    (a diagonal Jacobi step along a -0.99 correlation, no averaging)."""
    x, y = _uncentred_regression()
    lie = nb.LieGroupGuide(_model)
    result, warned = _run(lie, nb.LieGroupBLR(), 1000, x, y)
    assert warned == []
    # the positive site is the lognormal of AutoNormal (the affine group on log sigma), with a free spread
    assert {"sigma_lie_loc", "sigma_lie_scale"} <= set(result.params)
    ref = AutoNormal(_model)
    ref_result, _ = _run(ref, nb.BLR(), 1000, x, y)
    (e_lie, se_lie), (e_ref, se_ref) = _elbo(lie, result.params, x, y), _elbo(ref, ref_result.params, x, y)
    assert e_ref - e_lie < 1.0 + 3 * math.hypot(se_lie, se_ref), (e_lie, e_ref)
    ratio = float(lie.median(result.params)["sigma"]) / float(ref.median(ref_result.params)["sigma"])
    assert abs(ratio - 1) < 0.05, ratio


def test_default_start_is_numpyros_autoguide_start():
    """The guide starts where NumPyro's Gaussian autoguides (and nb.BLR() + AutoNormal, the yardstick of its
    robustness row) start: init_to_uniform. It started at init_to_median before, from which a latent random walk
    with a small prior scale (bench/robustness_cases.py's stochastic_volatility) ended 1.3 nats short in float32;
    docs/lie-group.md has the robustness row of each start."""
    assert nb.LieGroupGuide(_model).init_loc_fn is AutoNormal(_model).init_loc_fn is init_to_uniform


@pytest.mark.slow  # three 400-step fits of a 3-number model: ~10-20 s
def test_predictor_in_the_hundred_thousands_in_float32():
    """The regression above with its predictor times 1e3 (x ~ 1e5, as robustness case ``kidiq_momiq_x1e3``), in the
    suite's float32, from NumPyro's autoguide initialisation (``init_to_uniform``), two seeds: the sampled Hessian
    across the shifts spans about 14 orders of magnitude. The defaults reach the ELBO of nb.BLR() + AutoNormal
    within 1 nat (plus the estimates' Monte Carlo error) and sigma's median within 5%, with no warning, as on the
    unscaled predictor. Before, the joint step carried the dense precision P itself and factorised its inverse each
    step: in float32 that was non-finite, and 396 and 399 of the 400 steps were skipped (970 of 1,000 in the robustness
    case)."""
    x, y = _uncentred_regression()
    x = x * 1e3
    ref = AutoNormal(_model)
    ref_result, _ = _run(ref, nb.BLR(), 400, x, y)
    e_ref, se_ref = _elbo(ref, ref_result.params, x, y)
    for key in (0, 1):
        lie = nb.LieGroupGuide(_model, init_loc_fn=init_to_uniform)
        result, warned = _run(lie, nb.LieGroupBLR(), 400, x, y, key=key)
        assert warned == [], (key, warned)
        e_lie, se_lie = _elbo(lie, result.params, x, y)
        assert np.isfinite(e_lie) and e_ref - e_lie < 1.0 + 3 * math.hypot(se_lie, se_ref), (key, e_lie, e_ref)
        ratio = float(lie.median(result.params)["sigma"]) / float(ref.median(ref_result.params)["sigma"])
        assert abs(ratio - 1) < 0.05, (key, ratio)


def _varying_intercepts(x, group, n_groups, y=None):
    """Varying intercepts with an unknown noise scale, non-centred by hand (``a = tau * z``), as
    ``bench/robustness_cases.py``'s ``varying_intercepts_300``."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    b = numpyro.sample("b", dist.Normal(0.0, 5.0))
    tau = numpyro.sample("tau", dist.HalfNormal(2.0))
    sigma = numpyro.sample("sigma", dist.HalfNormal(2.0))
    with numpyro.plate("groups", n_groups):
        z = numpyro.sample("z", dist.Normal(0.0, 1.0))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Normal(mu + tau * z[group] + b * x, sigma), obs=y)


@pytest.mark.slow  # three 400-step fits of a 44-number model: ~15-30 s
def test_diagonal_step_reaches_the_mean_field_optimum_on_varying_intercepts():
    """The diagonal step (the one above the joint step's 256 numbers; ``joint_mean=False`` takes it at any size) on
    varying intercepts (40 groups of 8, unstandardised predictor), two seeds: within 1 nat of nb.BLR() + AutoNormal's
    ELBO (plus the estimates' Monte Carlo error) with no warning. Before, it took the scale's algebra gradient from
    the draw's reparameterisation gradient and the shift's from the raw gradient: seed 0 ended 0.38 nats short (the
    loss at the iterates still 3 nats above the optimum's after 400 steps), seed 1 diverged (warned). Now the scales
    read the Stein identity off a Hutchinson probe and the shifts take nb.BLR's control variate: 0.02-0.04 nats."""
    rng = np.random.default_rng(1)
    group = np.repeat(np.arange(40), 8)
    x = rng.normal(size=group.size) * 3.0 + 2.0
    y = 1.0 + 0.8 * rng.normal(size=40)[group] + 0.5 * x + rng.normal(size=group.size)
    args = (x, group, 40, y)

    def fit(guide, optim, key):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = SVI(_varying_intercepts, guide, optim, Trace_ELBO()).run(jax.random.PRNGKey(key), 400, *args,
                                                                             progress_bar=False)
        losses = jax.vmap(lambda k: Trace_ELBO().loss(k, result.params, _varying_intercepts, guide, *args))(
            jax.random.split(jax.random.PRNGKey(7), 4000))
        losses = np.asarray(losses, np.float64)
        warned = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        return -losses.mean(), losses.std() / math.sqrt(len(losses)), warned

    e_ref, se_ref, _ = fit(AutoNormal(_varying_intercepts), nb.BLR(), 0)
    for key in (0, 1):
        e_lie, se_lie, warned = fit(nb.LieGroupGuide(_varying_intercepts), nb.LieGroupBLR(joint_mean=False), key)
        assert warned == [], (key, warned)
        assert np.isfinite(e_lie) and e_ref - e_lie < 1.0 + 3 * math.hypot(se_lie, se_ref), (key, e_lie, e_ref)


@pytest.mark.slow
def test_a_stalled_fit_says_so():
    """A step size far too small for the run: the means are still travelling at the end, and the warning names the
    site (before: no warning)."""
    x, y = _uncentred_regression()
    guide = nb.LieGroupGuide(_model)
    _, warned = _run(guide, nb.LieGroupBLR(1e-4), 30, x, y)
    assert any("has not converged" in w and "'beta'" in w for w in warned), warned


def _mean_model(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    with numpyro.plate("n", y.shape[0]):
        numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)


@pytest.mark.slow
def test_a_loss_still_falling_while_a_mean_drifts_says_so():
    """The loss check of nb.BLR's report, for the Lie-group guide (it had none: float32 stochastic volatility ended
    1.5 nats short of the mean-field optimum with no warning, its loss 1.33 +- 0.36 nats lower over steps 512-1000
    than over 256-511 while the walk's scale moved 4.3 sd). A converged fit is silent; the same state with the
    previous block's losses higher by more than DRIFT_NATS (below report.STILL_FALLING_NATS) is reported only when a
    mean also moved DRIFT_SDS since the last block began, naming it; a drop over STILL_FALLING_NATS with a move of
    1 sd is reported too."""
    from numpyro_blr import liegroup_guide as lg
    from numpyro_blr import report as blr_report

    y = np.linspace(-1.0, 3.0, 20)
    opt, guide = nb.LieGroupBLR(), nb.LieGroupGuide(_mean_model)  # the optimizer finds its live guide
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = SVI(_mean_model, guide, opt, Trace_ELBO()).run(jax.random.PRNGKey(0), 100, y, progress_bar=False)
    assert [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)] == []
    report = nb.fit_report(result, opt)
    assert report.loss_drop is not None and report.problems == []
    s = result.state.optim_state[1]
    alg = s.algorithm
    assert set(alg.snapshot) == {"mu_lie_loc", "mu_lie_scale"}
    sd = float(result.params["mu_lie_scale"])  # A (get_params returns it constrained), times q0's sd 1

    def report_with(drop, moved_sds):  # the drop between the two blocks made `drop` nats
        blocks = alg.trace.loss_blocks.at[0, 1].add(drop - report.loss_drop[0])
        snapshot = {**alg.snapshot, "mu_lie_loc": result.params["mu_lie_loc"] - moved_sds * sd}
        trace = alg.trace._replace(loss_blocks=blocks)
        state = (result.state.optim_state[0], s._replace(algorithm=alg._replace(trace=trace, snapshot=snapshot)))
        return nb.fit_report(state, opt)

    small = 0.5 * (lg.DRIFT_NATS + blr_report.STILL_FALLING_NATS)  # over DRIFT_NATS, under STILL_FALLING_NATS
    assert small > 4.0 * report.loss_drop[1]  # and significant: the converged loss of a conjugate model hardly varies
    assert report_with(small, 0.0).problems == []
    assert report_with(small, 1.0).problems == []
    assert report_with(0.5 * lg.DRIFT_NATS, lg.DRIFT_SDS + 1.0).problems == []  # a drift too small in nats
    (problem,) = report_with(small, lg.DRIFT_SDS + 1.0).problems
    assert "likely not converged" in problem and "'mu' (3" in problem and "init_state=svi_result.state" in problem
    (problem,) = report_with(blr_report.STILL_FALLING_NATS + 1.0, 1.0).problems
    assert "likely not converged" in problem and "'mu' (1" in problem


@pytest.mark.slow
def test_a_diverging_fit_says_so():
    """lr = 1.5 without backtracking on the diagonal step: along the -0.99 correlation the step's Jacobi iteration
    multiplies the error by |1 - 1.5 * 1.99| ~ 2 per step and the loss overflows within a few steps: the report says
    the fit diverged or is not usable, and what to change (before: only that steps were skipped)."""
    x, y = _uncentred_regression()
    guide = nb.LieGroupGuide(_model)
    _, warned = _run(guide, nb.LieGroupBLR(1.5, backtrack=False, joint_mean=False), 30, x, y)
    assert any(("nb.LieGroupBLR diverged" in w or "not usable" in w) and "smaller lr (this run used 1.5)" in w
               for w in warned), warned


@pytest.mark.slow
def test_a_short_run_is_too_short_to_judge():
    x, y = _uncentred_regression()
    guide = nb.LieGroupGuide(_model)
    _, warned = _run(guide, nb.LieGroupBLR(), 5, x, y)
    assert any("too few to judge" in w for w in warned), warned


@pytest.mark.slow
def test_positive_sites_and_bad_arguments():
    """Positive sites: lognormal (affine on log) with the Gaussian default, the multiplicative group theta = g xi
    when a positive q0 is given; bad optimizer arguments are named."""
    x, y = _uncentred_regression(10)
    guide = nb.LieGroupGuide(_model, positive_base=dist.Gamma(10.0))
    svi = SVI(_model, guide, nb.LieGroupBLR(), Trace_ELBO())
    state = svi.init(jax.random.PRNGKey(0), x, y)
    params = svi.get_params(state)
    assert "sigma_lie_scale" in params and "sigma_lie_loc" not in params
    with pytest.raises(ValueError, match="backtrack"):
        nb.LieGroupBLR(backtrack="yes")
    with pytest.raises(ValueError, match="joint_mean"):
        nb.LieGroupBLR(joint_mean=1)


def _scales_model(X, y=None):
    """NumPyro's "variationally inferred parameterization" model in small (bench/robustness_cases.py's
    hierarchical_scales_logistic): per-feature log-scales around a global one, beta non-centred."""
    from numpyro import handlers
    from numpyro.infer.reparam import LocScaleReparam

    d = X.shape[1]
    log_tau_zero = numpyro.sample("log_tau_zero", dist.Normal(0.0, 10.0))
    log_tau_i = numpyro.sample("log_tau_i", dist.Normal(log_tau_zero, np.ones(d)))
    with handlers.reparam(config={"beta": LocScaleReparam(centered=0.0)}):
        beta = numpyro.sample("beta", dist.Normal(np.zeros(d), jax.numpy.exp(log_tau_i)))
    numpyro.sample("obs", dist.Bernoulli(logits=X @ beta), obs=y)


@pytest.mark.slow
def test_joint_step_reads_the_curvature_at_fresh_draws():
    """The default joint mean step averages the shift gradient and Hessian over its step's draw and
    ``curvature_draws`` (8) more (issue 25: one draw's curvature of a log-scale is heavy-tailed, and on
    hierarchical_scales_logistic the exponential map turned it into a scale growing by e per step until the fit
    diverged). The extra draws are read off this step's loss with the scale shrunk by e^-60, so that the draw sits at
    the point: they are the potential's gradient and Hessian at b + A eps_j, eps_j ~ N(0, I)."""
    from jax.flatten_util import ravel_pytree
    from numpyro.infer.svi import _make_loss_fn
    from numpyro.infer.util import potential_energy

    from numpyro_blr.liegroup_guide import CURVATURE_DRAWS, _shift_blocks, extra_draws

    rng = np.random.default_rng(0)
    X = rng.standard_normal((20, 2))
    y = (X[:, 0] - X[:, 1] + rng.standard_normal(20) > 0).astype(float)
    guide = nb.LieGroupGuide(_scales_model)
    optim = nb.LieGroupBLR()
    assert optim.curvature_draws == CURVATURE_DRAWS == 8
    svi = SVI(_scales_model, guide, optim, Trace_ELBO())
    state = svi.init(jax.random.PRNGKey(0), X, y)
    params = state.optim_state[1].params  # unconstrained: log-scales
    params = {**params, **{n: v + 0.5 for n, v in params.items() if n.endswith("_lie_scale")}}  # scales ~ 0.16
    layout = optim.layout(params)
    fn = _make_loss_fn(Trace_ELBO(), jax.random.PRNGKey(1), svi.constrain_fn, _scales_model, guide, (X, y), {}, {})
    # full float32 matrix products: a GPU's default (TF32) puts both sides 1e-3 apart, not the estimator
    with jax.default_matmul_precision("highest"):
        hess, grad, offsets, finite = jax.jit(lambda p: extra_draws(fn, p, layout, jax.random.PRNGKey(2), 3))(params)
    blocks = _shift_blocks(layout)
    assert [b.site for b in blocks] and bool(np.all(finite))
    loc = {b.site: params[b.loc_param] for b in blocks}
    flat, unravel = ravel_pytree(loc)
    order = np.concatenate([np.arange(np.size(loc[b.site])) + sum(np.size(loc[c.site]) for c in blocks
                            if c.site < b.site) for b in blocks])  # ravel_pytree sorts the sites by name
    scale = np.concatenate([np.broadcast_to(np.exp(params[b.scale_param]), np.shape(loc[b.site])).reshape(-1)
                            for b in blocks])

    def potential(x):
        return potential_energy(_scales_model, (X,), {"y": y}, unravel(x))

    points = np.empty((3, flat.shape[0]), np.asarray(flat).dtype)
    points[:, order] = np.asarray(flat)[order] + np.asarray(offsets)  # offsets are in the blocks' order
    with jax.default_matmul_precision("highest"):
        g_ref, h_ref = jax.jit(jax.vmap(lambda x: (jax.grad(potential)(x), jax.hessian(potential)(x))))(points)
    tol = dict(rtol=1e-5, atol=1e-5)  # float32 (the test suite's precision)
    np.testing.assert_allclose(grad, np.asarray(g_ref)[:, order], **tol)
    np.testing.assert_allclose(hess, np.asarray(h_ref)[:, order][:, :, order], **tol)
    eps = np.asarray(offsets) / scale  # the draws are A eps with eps ~ N(0, I), fresh for every coordinate
    assert eps.shape == (3, 5) and np.all(np.abs(eps) < 6) and len(np.unique(np.round(eps, 12))) == 15
    with pytest.raises(ValueError, match="curvature_draws"):
        nb.LieGroupBLR(curvature_draws=-1)
    with pytest.raises(ValueError, match="curvature_draws"):
        nb.LieGroupBLR(curvature_draws=True)


@pytest.mark.slow  # four small programs: ~5 s
def test_diagonal_step_probes_each_site_as_nb_blr_does():
    """The diagonal step's curvature (``probed_loss_and_diagonals``) is nb.BLR's Hutchinson estimator in the whitened
    shifts: one pass gives the loss and gradients of the plain gradient pass, and the estimates of diag(A H A), each
    site probed on its own. A scalar site's estimate is then exactly A^2 H_ii (its probe's sign squares to one and
    no other site's coordinate moves); a vector site's is unbiased: its mean over probes is A^2 H_ii within the
    Monte Carlo error, H from the exact Hessian of the same loss (``shift_hessian``)."""
    from numpyro.infer.svi import _make_loss_fn
    from numpyro.optim import _value_and_grad

    from numpyro_blr.liegroup_guide import _shift_blocks, hessian_diagonals, probed_loss_and_diagonals, shift_hessian

    rng = np.random.default_rng(0)
    X = rng.standard_normal((20, 3))
    y = (X[:, 0] - X[:, 1] + rng.standard_normal(20) > 0).astype(float)
    guide = nb.LieGroupGuide(_scales_model)
    optim = nb.LieGroupBLR()
    svi = SVI(_scales_model, guide, optim, Trace_ELBO())
    params = svi.init(jax.random.PRNGKey(0), X, y).optim_state[1].params
    layout = optim.layout(params)
    fn = _make_loss_fn(Trace_ELBO(), jax.random.PRNGKey(1), svi.constrain_fn, _scales_model, guide, (X, y), {}, {})
    keys = jax.random.split(jax.random.PRNGKey(2), 4000)
    with jax.default_matmul_precision("highest"):
        (loss, _), grads, diag = jax.jit(lambda p, k: probed_loss_and_diagonals(fn, p, layout, k))(params, keys[0])
        (loss_ref, _), grads_ref = jax.jit(lambda p: _value_and_grad(fn, x=p, forward_mode_differentiation=False))(params)
        many = jax.jit(jax.vmap(lambda k: probed_loss_and_diagonals(fn, params, layout, k)[2]))(keys)
        hess_diag = jax.jit(lambda p: hessian_diagonals(shift_hessian(fn, p, layout), p, layout))(params)
    tol = dict(rtol=1e-5, atol=1e-5)  # float32 (the test suite's precision)
    np.testing.assert_allclose(loss, loss_ref, **tol)
    for n in grads_ref:
        np.testing.assert_allclose(grads[n], grads_ref[n], **tol)
    blocks = [b for b in _shift_blocks(layout) if b.group == "affine"]
    assert sorted(diag) == sorted(b.loc_param for b in blocks) and len(blocks) == 3
    for b in blocks:
        exact = np.asarray(np.exp(params[b.scale_param]) ** 2 * hess_diag[b.loc_param])
        draws = np.asarray(many[b.loc_param])
        if np.ndim(exact) == 0:  # a probe of its own: exact
            np.testing.assert_allclose(draws, np.broadcast_to(exact, draws.shape), rtol=1e-4, atol=1e-6)
        else:  # the coupling between the site's coordinates is the noise: mean within 4 standard errors
            assert draws.std(0).max() > 0, b.site
            se = draws.std(0) / math.sqrt(draws.shape[0])
            assert np.all(np.abs(draws.mean(0) - exact) <= 4 * se + 1e-6), (b.site, draws.mean(0), exact, se)


@pytest.mark.slow  # two fits of the 63-number model: ~10-30 s
def test_hierarchical_scales_do_not_diverge():
    """hierarchical_scales_logistic (breast cancer, 63 numbers), 150 steps of the default: the loss stays bounded, no
    step is skipped and no warning is raised. Without the extra draws (curvature_draws=0, the rule before) the
    single-draw Stein estimate A^2 H_ii - 1 of log_tau_i's scale reached -1e3 (H_ii < 0 in a concave stretch of the
    potential along a log-scale), the exponential map grew the scale by the clip's factor e per step (0.8 to 110 in
    ten steps) and the fit diverged: 912 of 1,000 steps skipped.

    nb.Trace_ELBO sums the sites in a fixed order: with NumPyro's (a set's order, which follows PYTHONHASHSEED) the
    float32 losses differ in their last bits from process to process, and after 150 steps the report's "loss still
    falling" check (added after this test) fired for some hash seeds and not others. That check is about
    convergence, not divergence: the test reads the warnings about divergence and skipped steps."""
    from sklearn.datasets import load_breast_cancer

    X, y = load_breast_cancer(return_X_y=True)
    X = (X - X.mean(0)) / X.std(0)
    X = np.concatenate([np.ones((X.shape[0], 1)), X], axis=1)

    def fit(optim):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            guide = nb.LieGroupGuide(_scales_model)
            result = SVI(_scales_model, guide, optim, nb.Trace_ELBO()).run(jax.random.PRNGKey(0), 150, X, y,
                                                                            progress_bar=False)
        return result, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)
                        and ("diverged" in str(w.message) or "skipped" in str(w.message))]

    result, warned = fit(nb.LieGroupBLR())
    losses = np.asarray(result.losses)
    assert warned == [] and np.all(np.isfinite(losses)) and losses[50:].max() < 1e3, (warned, losses.max())
    assert bool(result.state.optim_state[1].algorithm.draws_on)  # log_tau_i's sampled curvature went negative
    # the rule before the draws, and before growth_radius too (which alone kept this start from diverging in 150 steps)
    old, warned_old = fit(nb.LieGroupBLR(curvature_draws=0, growth_radius=float("inf")))
    assert np.nanmax(np.asarray(old.losses)) > 1e6 and warned_old, warned_old


@pytest.mark.slow  # two fits of the 63-number model: ~10-20 s
def test_far_start_on_log_scales_converges():
    """hierarchical_scales_logistic started where NumPyro's init_to_median put seed 6 of the robustness bench
    (log_tau_zero = log_tau_i = 5.8, beta_decentered +-0.5: coefficients of +-165, saturated logits, a loss of 1e5).
    The rule before growth_radius (a scale's exponential map clipped at a factor e per step on both sides) grew
    log_tau_i's scales on draws of strongly negative curvature (at the bench's seed 6, float64: the largest from 0.1
    to 22 in 13 steps), the draws' exp(log_tau_i) overflowed and most steps were skipped (122-142 of 150 over three seeds in float32, the suite's precision; 97-122
    in float64). Bounded at sqrt(2) per step, as nb.BLR's one-sided precision step bounds it, the default converges
    from there (loss after 150 steps: 95-106 over those seeds, float32) as nb.BLR() + AutoNormal does (102-242)."""
    from numpyro.infer.initialization import init_to_value
    from sklearn.datasets import load_breast_cancer

    X, y = load_breast_cancer(return_X_y=True)
    X = (X - X.mean(0)) / X.std(0)
    X = np.concatenate([np.ones((X.shape[0], 1)), X], axis=1)
    d = X.shape[1]
    far = {"log_tau_zero": 5.8, "log_tau_i": np.full(d, 5.8), "beta_decentered": 0.5 * (-1.0) ** np.arange(d)}

    def fit(optim):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            guide = nb.LieGroupGuide(_scales_model, init_loc_fn=init_to_value(values=far))
            result = SVI(_scales_model, guide, optim, nb.Trace_ELBO()).run(jax.random.PRNGKey(0), 150, X, y,
                                                                            progress_bar=False)
        return np.asarray(result.losses), [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)
                                           and ("diverged" in str(w.message) or "skipped" in str(w.message))]

    losses, warned = fit(nb.LieGroupBLR())
    assert losses[0] > 1e5  # the start is far
    assert warned == [] and np.all(np.isfinite(losses)) and np.median(losses[-20:]) < 150, (warned, losses[-20:])
    before, warned_before = fit(nb.LieGroupBLR(growth_radius=float("inf")))
    assert warned_before and not np.median(before[-20:]) < 150, (warned_before, before[-20:])
    with pytest.raises(ValueError, match="growth_radius must be > 0"):
        nb.LieGroupBLR(growth_radius=0.0)


@pytest.mark.slow  # two short fits: ~3-6 s
def test_convex_potential_keeps_the_one_draw_step():
    """The extra draws switch on only after a sampled Hessian had a negative diagonal entry (one draw's scale
    gradient A^2 H_ii - 1 is then unbounded below): on the uncentred regression with unknown noise, whose sampled
    Hessians have a positive diagonal, the default's steps are bit for bit those of curvature_draws=0."""
    x, y = _uncentred_regression(20)
    out = []
    for k in (None, 0):
        guide = nb.LieGroupGuide(_model)
        svi = SVI(_model, guide, nb.LieGroupBLR(curvature_draws=k), Trace_ELBO())
        result = svi.run(jax.random.PRNGKey(0), 12, x, y, progress_bar=False)
        out.append((result.params, np.asarray(result.losses), bool(result.state.optim_state[1].algorithm.draws_on)))
    (p8, l8, on8), (p0, l0, on0) = out
    assert not on8 and not on0
    np.testing.assert_array_equal(l8, l0)
    for n in p0:
        np.testing.assert_array_equal(p8[n], p0[n])

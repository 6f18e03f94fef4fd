"""nb.BLR()'s curvature averaged over several draws of q (issue 25, ``hierarchical_scales_logistic``): with the exact
Hessian at one draw, a curvature that is negative with a heavy tail (hierarchical log-scales) biases the precision
step's fixed point through the positivity rule's second-order term; once a run has seen such draws it averages
the Hessians and gradients of ``curvature_draws`` draws (``BLR._curvature_draws``). The extra draws are exact draws
of q, obtained from the loss's own fixed epsilon by moving the means and shrinking the scales
(``estimators.svi.shifted_draw_params``); models whose single-draw curvature is never negative never switch."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.infer import SVI, Trace_ELBO
from numpyro.infer.autoguide import AutoMultivariateNormal, AutoNormal
from numpyro.infer.svi import _make_loss_fn

import numpyro_blr as nb
from numpyro_blr.estimators.svi import BASELINE_SHRINK, extra_draws


def quadratic_model():
    numpyro.sample("x", dist.Normal(0.0, 1.0).expand([3]).to_event(1))


@pytest.mark.slow
def test_extra_draws_are_exact_draws_of_q():
    """On l(z) = |z|^2/2 + const the gradient at a draw is the draw itself: the extra draws have the guide's mean and
    covariance, the exact Hessian I, and the offsets they return are z_k - m up to this step's own c (z - m)."""
    guide = AutoMultivariateNormal(quadratic_model)
    opt = nb.BLR(curvature_draws=8)
    svi = SVI(quadratic_model, guide, opt, Trace_ELBO())
    state = svi.init(jax.random.PRNGKey(0))
    params = dict(state.optim_state[1].params)
    tril = jnp.array([[0.7, 0.0, 0.0], [0.3, 0.5, 0.0], [-0.2, 0.4, 1.3]])
    params["auto_loc"] = jnp.array([0.5, -1.0, 2.0])
    layout = opt.layout(params)
    (block,) = [b for b in layout.blocks if b.loc == "auto_loc"]
    params[block.scale] = block.transform.inv(tril)
    fn = _make_loss_fn(Trace_ELBO(), jax.random.PRNGKey(1), svi.constrain_fn, quadratic_model, guide, (), {}, {})
    n = 2000
    losses, grads, hess, offsets = jax.jit(lambda p: extra_draws(fn, p, layout, jax.random.PRNGKey(2), n))(params)
    z = np.asarray(grads["auto_loc"])
    assert np.all(np.isfinite(np.asarray(losses)))
    np.testing.assert_allclose(np.asarray(hess), np.broadcast_to(np.eye(3), (n, 3, 3)), atol=1e-5)
    cov = np.asarray(tril @ tril.T)
    se = np.sqrt(np.diag(cov) / n)
    assert np.all(np.abs(z.mean(0) - np.asarray(params["auto_loc"])) < 5 * se)
    np.testing.assert_allclose(np.cov(z.T), cov, atol=0.15)
    # z_k - m = offsets_k + c (z - m): the difference is the same for every draw and within c |z - m| of m
    rest = z - np.asarray(offsets["auto_loc"])
    np.testing.assert_allclose(rest, np.broadcast_to(rest[0], rest.shape), atol=1e-4)
    assert np.all(np.abs(rest[0] - np.asarray(params["auto_loc"])) < 10 * BASELINE_SHRINK * np.sqrt(np.diag(cov)))


def poisson_regression(x, y=None):
    b = numpyro.sample("b", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    numpyro.sample("y", dist.Poisson(jnp.exp(b[0] + b[1] * x)), obs=y)


def log_scale_model(x, y=None):
    """Per-coefficient log-scales over non-centred coefficients: d^2 l / d log_tau^2 contains
    e^{log_tau} z dl/dbeta, negative at many draws (the structure of ``hierarchical_scales_logistic``)."""
    log_tau = numpyro.sample("log_tau", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    z = numpyro.sample("z", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    numpyro.sample("y", dist.Normal(x @ (jnp.exp(log_tau) * z), 1.0), obs=y)


def _run(model, guide_cls, args, steps=60, **kw):
    opt = nb.BLR(**kw)
    result = SVI(model, guide_cls(model), opt, Trace_ELBO()).run(jax.random.PRNGKey(0), steps, *args,
                                                                  progress_bar=False)
    return result.state.optim_state[1].algorithm, result


@pytest.mark.slow  # one fit: its compilation takes 3-7 s on 2 loaded cores
def test_negative_single_draw_curvature_switches_to_several_draws():
    """The log-scale model's single-draw curvature is negative with a heavy tail: within 60 steps the run has
    switched to the averaged draws, and its losses are finite."""
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(30, 4)).astype(np.float32)
    ys = (1.5 * xs @ rng.normal(size=4) + rng.normal(size=30)).astype(np.float32)
    state, result = _run(log_scale_model, AutoMultivariateNormal, (xs, ys), curvature_draws=8)
    assert bool(state.curvature_switched)
    assert float(max(jnp.max(v) for v in state.curvature_noise.values())) > 0.0
    assert np.all(np.isfinite(np.asarray(result.losses)))


@pytest.mark.slow  # three fits (their compilation: 2-3 s each on 2 loaded cores)
def test_log_concave_model_never_switches():
    """A Poisson regression (log-concave: its Hessian is positive definite at every draw) never switches, and its
    fit is that of one draw per step (``curvature_draws=1``), with ``curvature_draws=8`` and with the default (which
    decides as 8 does, takes one draw's step and is not rerun)."""
    x = np.linspace(-1.0, 1.0, 12)
    y = np.array([0, 1, 1, 0, 2, 1, 3, 2, 4, 3, 6, 5], np.float32)
    one_state, one = _run(poisson_regression, AutoNormal, (x, y), curvature_draws=1)
    assert one_state.curvature_noise == {}
    for draws in (8, None):
        state, result = _run(poisson_regression, AutoNormal, (x, y), curvature_draws=draws)
        assert state.curvature_switched.shape == () and not bool(state.curvature_switched)
        assert float(max(jnp.max(v) for v in state.curvature_noise.values())) == 0.0
        for k in result.params:
            np.testing.assert_allclose(np.asarray(result.params[k]), np.asarray(one.params[k]), rtol=1e-6, atol=1e-7)


def test_default_decides_and_reruns_with_averaged_draws():
    """nb.BLR()'s default decides as curvature_draws=8 does but steps with one draw; the optimizer a rerun uses is
    a copy with curvature_draws=8 whose steps are its own (the algorithm bound to the copy), and an explicit
    curvature_draws is never rerun."""
    opt = nb.BLR(lr=0.1)
    assert opt.draws_on_rerun and opt.curvature_draws == 8
    other = opt.with_curvature_draws(8)
    assert not other.draws_on_rerun and other.curvature_draws == 8 and other.lr == opt.lr
    assert other.algorithm.step.__self__ is other and opt.algorithm.step.__self__ is opt
    assert nb.compile_once._optimizer_key(other) != nb.compile_once._optimizer_key(opt)
    svi = SVI(quadratic_model, AutoNormal(quadratic_model), nb.BLR(curvature_draws=8), Trace_ELBO())
    state = svi.init(jax.random.PRNGKey(0))
    assert svi.optim.rerun_optimizer(state.optim_state) is None  # explicit: never rerun
    assert opt.rerun_optimizer(state.optim_state) is None  # not switched
    i, s = state.optim_state
    switched = (i, s._replace(algorithm=s.algorithm._replace(curvature_switched=jnp.array(True))))
    assert opt.rerun_optimizer(switched) is None  # switched, but no step taken
    ten = (jnp.asarray(10, i.dtype), switched[1])
    assert isinstance(opt.rerun_optimizer(ten), nb.BLR)  # switched, and the report finds a problem (its clock at 0)
    # keep_rerun: the rerun, unless its report finds a problem too (here: no step) and the first fit ended lower
    first, again = (state.optim_state, np.full(10, 5.0)), (state.optim_state, np.ones(10))
    assert opt.keep_rerun(first, again) and not opt.keep_rerun(again, first)
    assert not opt.keep_rerun(again, (state.optim_state, np.array([1.0, np.nan])))  # a non-finite end: never kept


def test_curvature_draws_is_checked():
    for bad in (0, 1.5, True, -2, "8"):
        with pytest.raises(ValueError, match="curvature_draws"):
            nb.BLR(curvature_draws=bad)

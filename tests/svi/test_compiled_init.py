"""svi.init with our optimizers runs NumPyro's start (the guide's setup, the search for valid initial values, the
optimizer's state) as one compiled program (numpyro_blr.compile_once.compiled_init, issue 24): the same state as
NumPyro's eager SVI.init to rounding, the guide set up alike, reused on new data of the same shapes, and NumPyro's
own init where the start cannot be traced."""

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.infer import SVI, Trace_ELBO
from numpyro.infer.autoguide import AutoDelta, AutoDiagonalNormal, AutoMultivariateNormal, AutoNormal

import numpyro_blr as nb
from conftest import count_compiles
from numpyro_blr import compile_once

pytestmark = pytest.mark.compiled_init

# NumPyro's SVI.init as it is without this package (install_svi_checks wraps it with functools.wraps)
EAGER_INIT = SVI.init.__wrapped__


def regression(x, y=None, scale=5.0):
    a = numpyro.sample("a", dist.Normal(0.0, scale))
    b = numpyro.sample("b", dist.Normal(0.0, scale))
    s = numpyro.sample("s", dist.HalfNormal(2.0))
    with numpyro.plate("n", x.shape[0]):
        numpyro.sample("y", dist.Normal(a + b * x, s), obs=y)


def hand_written_guide(x, y=None, scale=5.0):
    loc = numpyro.param("ab_loc", np.zeros(2, np.float32))
    sd = numpyro.param("ab_sd", np.ones(2, np.float32), constraint=dist.constraints.positive)
    ab = numpyro.sample("ab", dist.Normal(loc, sd).to_event(1), infer={"is_auxiliary": True})
    numpyro.sample("a", dist.Delta(ab[0]))
    numpyro.sample("b", dist.Delta(ab[1]))
    s_loc = numpyro.param("s_loc", 0.0)
    s_sd = numpyro.param("s_sd", 0.5, constraint=dist.constraints.positive)
    numpyro.sample("s", dist.LogNormal(s_loc, s_sd))


def data(n=40, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=n).astype(np.float32)
    return x, (1.0 - 2.0 * x + 0.5 * rng.normal(size=n)).astype(np.float32)


@pytest.fixture
def starts(monkeypatch):
    """The states compiled_init returned (None where NumPyro's own init ran)."""
    seen, original = [], compile_once.compiled_init

    def spy(*args, **kwargs):
        seen.append(original(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(compile_once, "compiled_init", spy)
    return seen

GUIDES = {
    "AutoNormal": lambda: AutoNormal(regression),
    "AutoDiagonalNormal": lambda: AutoDiagonalNormal(regression),
    "AutoMultivariateNormal": lambda: AutoMultivariateNormal(regression),
    "AutoDelta": lambda: AutoDelta(regression),
    "hand-written": lambda: hand_written_guide,
}
# make test-fast: the first guide (the cases after it are slow, as for the suite's other parametrized tests)
GUIDE_CASES = [pytest.param(n, marks=pytest.mark.slow) if i else n for i, n in enumerate(GUIDES)]


def _close(a, b):
    """Equal to float32 rounding (a few ulps): the program fuses operations that NumPyro runs one by one."""
    for (path, u), v in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-6, atol=1e-7, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("name", GUIDE_CASES)
def test_compiled_init_equals_numpyros_eager_init(name, starts):
    x, y = data()
    key = jax.random.PRNGKey(3)
    ours = SVI(regression, GUIDES[name](), nb.BLR(), Trace_ELBO())
    theirs = SVI(regression, GUIDES[name](), nb.BLR(), Trace_ELBO())
    state = ours.init(key, x, y=y)
    assert len(starts) == 1 and starts[0] is state  # the compiled start gave it
    theirs.optim = theirs.optim.bound_to(theirs.guide, (x,), {"y": y})
    reference = EAGER_INIT(theirs, key, x, y=y)
    assert jax.tree.structure(state) == jax.tree.structure(reference)
    _close(state, reference)
    _close(ours.get_params(state), theirs.get_params(reference))  # svi.constrain_fn: the same transforms
    if name != "hand-written":  # the guide is set up with concrete values, in the same site order
        assert list(ours.guide._init_locs) == list(theirs.guide._init_locs)
        assert not any(isinstance(v, jax.core.Tracer) for v in jax.tree.leaves(vars(ours.guide)))
        _close(ours.guide._init_locs, theirs.guide._init_locs)
        # the guide is usable outside SVI: its draws at the fitted parameters are NumPyro's
        draw = numpyro.handlers.seed(numpyro.handlers.substitute(ours.guide, data=ours.get_params(state)), 0)
        their_draw = numpyro.handlers.seed(numpyro.handlers.substitute(theirs.guide, data=theirs.get_params(reference)), 0)
        _close(draw(x, y=y), their_draw(x, y=y))


@pytest.mark.slow
def test_init_params_and_static_kwargs_are_numpyros(starts):
    """``init_params`` (constrained values for the guide's param sites) and SVI's static keyword arguments."""
    x, y = data()
    key = jax.random.PRNGKey(0)
    start = {"auto_loc": np.array([0.5, -1.0, 0.1], np.float32), "auto_scale_tril": 0.2 * np.eye(3, dtype=np.float32)}
    ours = SVI(regression, AutoMultivariateNormal(regression), nb.BLR(), Trace_ELBO(), scale=2.0)
    theirs = SVI(regression, AutoMultivariateNormal(regression), nb.BLR(), Trace_ELBO(), scale=2.0)
    state = ours.init(key, x, y=y, init_params=start)
    assert starts == [state]
    reference = EAGER_INIT(theirs, key, x, y=y, init_params=start)
    _close(state, reference)
    np.testing.assert_allclose(ours.get_params(state)["auto_loc"], start["auto_loc"], rtol=1e-6)
    # the static scale reached the model: the loss at the start is the model's with scale=2, not 5
    loss = float(ours.evaluate(state, x, y=y))
    assert np.isclose(loss, float(theirs.evaluate(reference, x, y=y)), rtol=1e-6)
    default = SVI(regression, AutoMultivariateNormal(regression), nb.BLR(), Trace_ELBO())
    assert not np.isclose(loss, float(default.evaluate(default.init(key, x, y=y, init_params=start), x, y=y)), rtol=1e-3)


@pytest.mark.slow
def test_new_data_of_the_same_shapes_and_a_guide_built_anew_compile_nothing():
    """The start is cached like nb.fit's programs: by the model, the guide's class and options, the optimizer's
    configuration and the arguments' shapes; a new SVI of the same (a loop over data sets) runs it again."""
    x, y = data()
    SVI(regression, AutoNormal(regression), nb.BLR(), Trace_ELBO()).init(jax.random.PRNGKey(0), x, y=y)
    x2, y2 = data(seed=1)
    svi = SVI(regression, AutoNormal(regression), nb.BLR(), Trace_ELBO())
    with count_compiles() as compiles:
        state = svi.init(jax.random.PRNGKey(1), x2, y=y2)
        params = svi.get_params(state)
    assert compiles["compile"] == 0
    assert set(params) == {"a_auto_loc", "a_auto_scale", "b_auto_loc", "b_auto_scale", "s_auto_loc", "s_auto_scale"}
    # and the fit runs from it as from NumPyro's start
    res = svi.run(jax.random.PRNGKey(1), 200, x2, y=y2, progress_bar=False)
    assert np.isfinite(np.asarray(res.losses)).all()
    assert abs(float(res.params["b_auto_loc"]) - float(np.polyfit(x2, y2, 1)[0])) < 0.1


def reads_its_data_in_python(x, y=None):
    center = float(np.mean(np.asarray(x)))  # fails when x is traced: NumPyro's own (eager) init is used
    a = numpyro.sample("a", dist.Normal(0.0, 5.0))
    b = numpyro.sample("b", dist.Normal(0.0, 5.0))
    with numpyro.plate("n", x.shape[0]):
        numpyro.sample("y", dist.Normal(a + b * (x - center), 1.0), obs=y)


def test_a_model_that_reads_its_data_in_python_gets_numpyros_init(starts):
    x, y = data()
    key = jax.random.PRNGKey(2)
    ours = SVI(reads_its_data_in_python, AutoNormal(reads_its_data_in_python), nb.BLR(), Trace_ELBO())
    theirs = SVI(reads_its_data_in_python, AutoNormal(reads_its_data_in_python), nb.BLR(), Trace_ELBO())
    state = ours.init(key, x, y=y)
    assert starts == [None]  # the compiled start failed: NumPyro's ran
    theirs.optim = theirs.optim.bound_to(theirs.guide, (x,), {"y": y})
    reference = EAGER_INIT(theirs, key, x, y=y)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(reference)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # NumPyro's own: bit for bit
    assert not any(isinstance(v, jax.core.Tracer) for v in jax.tree.leaves(vars(ours.guide)))
    assert set(ours.get_params(state)) == {"a_auto_loc", "a_auto_scale", "b_auto_loc", "b_auto_scale"}


def test_init_inside_jit_is_numpyros(starts):
    """Traced arguments (svi.init inside the user's jit) run NumPyro's init in that trace."""
    x, y = data()
    svi = SVI(regression, AutoNormal(regression), nb.BLR(), Trace_ELBO())
    state = jax.jit(lambda key, x, y: svi.init(key, x, y=y))(jax.random.PRNGKey(0), x, y)
    assert starts == [None]
    assert np.isfinite(np.asarray(state.optim_state[1].params["b_auto_loc"]))

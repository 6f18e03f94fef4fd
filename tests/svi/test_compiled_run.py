"""svi.run with our optimizers runs nb.fit's program (numpyro_blr.compile_once.compiled_run, issue 24): the start and
the steps compiled once with the data as arguments. Its fit is NumPyro's SVI.run's to rounding, a second SVI object
on new data of the same shapes compiles nothing, the SVI object and its guide are usable afterwards as after
NumPyro's run, and NumPyro's own run is used where the program cannot run the model."""

import warnings

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.infer import SVI, Trace_ELBO
from numpyro.infer.autoguide import AutoMultivariateNormal, AutoNormal

import numpyro_blr as nb
from conftest import count_compiles, numpyro_svi
from numpyro_blr import compile_once

pytestmark = pytest.mark.compiled_init


def regression(x, y=None):
    a = numpyro.sample("a", dist.Normal(0.0, 5.0))
    b = numpyro.sample("b", dist.Normal(0.0, 5.0))
    s = numpyro.sample("s", dist.HalfNormal(2.0))
    with numpyro.plate("n", x.shape[0]):
        numpyro.sample("y", dist.Normal(a + b * x, s), obs=y)


def reads_its_data_in_python(x, y=None):
    centre = float(np.mean(np.asarray(y)))  # fine under NumPyro's run (its data are constants), not in a program
    a = numpyro.sample("a", dist.Normal(centre, 5.0))
    with numpyro.plate("n", x.shape[0]):
        numpyro.sample("y", dist.Normal(a + x, 1.0), obs=y)


def data(n=40, seed=0, slope=-2.0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=n)
    return x, 1.0 + slope * x + 0.5 * rng.normal(size=n)


@pytest.fixture
def runs(monkeypatch):
    """The results compiled_run returned (None where NumPyro's own run ran)."""
    seen, original = [], compile_once.compiled_run

    def spy(*args, **kwargs):
        seen.append(original(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(compile_once, "compiled_run", spy)
    return seen


def _close(result, ref):
    for k in ref.params:
        np.testing.assert_allclose(result.params[k], ref.params[k], rtol=1e-9, atol=1e-12, err_msg=k)
    np.testing.assert_allclose(result.losses, ref.losses, rtol=1e-9)


@pytest.mark.slow  # NumPyro's eager start and its run, compiled for the reference: 10-12 s cold
@pytest.mark.parametrize("guide_cls", [AutoNormal, AutoMultivariateNormal])
def test_svi_run_is_numpyros_fit(guide_cls, runs):
    """In float64, to rounding: the program sums the ELBO's terms in a fixed order and fuses what NumPyro runs apart."""
    with jax.enable_x64(True):
        x, y = data()
        key = jax.random.PRNGKey(3)
        svi = SVI(regression, guide_cls(regression), nb.BLR(), Trace_ELBO())
        result = svi.run(key, 40, x, y=y, progress_bar=False)
        assert runs[-1] is result  # nb.fit's program ran it
        with numpyro_svi():
            ref = SVI(regression, guide_cls(regression), nb.BLR(), Trace_ELBO()).run(key, 40, x, y=y, progress_bar=False)
        _close(result, ref)
        # the SVI object and its guide, as after NumPyro's run
        params = svi.get_params(result.state)
        for k in ref.params:
            np.testing.assert_allclose(params[k], ref.params[k], rtol=1e-9, atol=1e-12)
        assert set(svi.guide.median(result.params)) == {"a", "b", "s"}


def test_a_second_svi_on_new_data_compiles_nothing_and_fits_them(runs):
    """A new SVI object, guide and optimizer on new data of the same shapes (and another step count) runs the same
    program: nothing is compiled, and the fit is of the new data (not of constants kept from the first)."""
    with jax.enable_x64(True):
        key = jax.random.PRNGKey(3)
        x, y = data()
        first = SVI(regression, AutoNormal(regression), nb.BLR(), Trace_ELBO()).run(key, 40, x, y=y, progress_bar=False)
        x2, y2 = data(seed=1, slope=3.0)
        with count_compiles() as counts:
            again = SVI(regression, AutoNormal(regression), nb.BLR(), Trace_ELBO()).run(key, 60, x2, y=y2,
                                                                                       progress_bar=False)
        assert counts["compile"] == 0
        assert runs[-1] is again and len(again.losses) == 60
        # each fit's slope is its data's (-2, then 3; 5 apart), to within 0.3: about 4 posterior sds (0.5 / sqrt(40))
        assert abs(float(first.params["b_auto_loc"]) + 2.0) < 0.3
        assert abs(float(again.params["b_auto_loc"]) - 3.0) < 0.3


@pytest.mark.slow
def test_a_second_svi_on_new_data_is_numpyros_fit_of_them(runs):
    """The program reused on new data gives NumPyro's fit of those data, to rounding."""
    with jax.enable_x64(True):
        key = jax.random.PRNGKey(3)
        x, y = data()
        SVI(regression, AutoMultivariateNormal(regression), nb.BLR(), Trace_ELBO()).run(key, 40, x, y=y,
                                                                                         progress_bar=False)
        x2, y2 = data(seed=1, slope=3.0)
        again = SVI(regression, AutoMultivariateNormal(regression), nb.BLR(), Trace_ELBO()).run(key, 40, x2, y=y2,
                                                                                               progress_bar=False)
        assert runs[-1] is again
        with numpyro_svi():
            ref2 = SVI(regression, AutoMultivariateNormal(regression), nb.BLR(), Trace_ELBO()).run(
                key, 40, x2, y=y2, progress_bar=False)
        _close(again, ref2)


@pytest.mark.slow
def test_progress_bar_and_a_continued_run_give_the_same_fit(runs):
    with jax.enable_x64(True):
        x, y = data()
        key = jax.random.PRNGKey(0)
        svi = SVI(regression, AutoNormal(regression), nb.BLR(), Trace_ELBO())
        whole = svi.run(key, 60, x, y=y, progress_bar=False)
        shown = svi.run(key, 60, x, y=y)  # 20 calls of the program's steps
        _close(shown, whole)
        first = svi.run(key, 20, x, y=y, progress_bar=False)
        rest = svi.run(key, 40, x, y=y, progress_bar=False, init_state=first.state)
        np.testing.assert_allclose(np.concatenate([first.losses, rest.losses]), whole.losses, rtol=1e-9)
        # continued on a new SVI object (NumPyro's SVI learns the constraints only in svi.init)
        other = SVI(regression, AutoNormal(regression), nb.BLR(), Trace_ELBO())
        rest2 = other.run(key, 40, x, y=y, progress_bar=False, init_state=first.state)
        _close(rest2, rest)
        assert other.get_params(rest2.state).keys() == rest.params.keys()
        assert all(r is not None for r in runs)


@pytest.mark.slow
def test_numpyros_run_where_the_program_cannot_run_the_model(runs):
    """A model that reads its data in Python runs under svi.run as before (nb.fit refuses it with a TypeError that
    names the argument: tests/workflow/test_fit.py); init_params and forward-mode differentiation, which nb.fit does
    not take, go to NumPyro's run as well."""
    x, y = data(n=12)
    svi = SVI(reads_its_data_in_python, AutoNormal(reads_its_data_in_python), nb.BLR(), Trace_ELBO())
    result = svi.run(jax.random.PRNGKey(0), 10, x, y=y, progress_bar=False)
    assert runs == [None]
    with numpyro_svi():
        ref = SVI(reads_its_data_in_python, AutoNormal(reads_its_data_in_python), nb.BLR(), Trace_ELBO()).run(
            jax.random.PRNGKey(0), 10, x, y=y, progress_bar=False)
    np.testing.assert_allclose(result.losses, ref.losses, rtol=1e-6)
    # the next svi.run of it goes straight to NumPyro's
    svi.run(jax.random.PRNGKey(1), 10, x, y=y, progress_bar=False)
    assert runs == [None, None]
    svi = SVI(regression, AutoNormal(regression), nb.BLR(), Trace_ELBO())
    start = {"a": 0.5, "b": -1.0, "s": 1.0}
    svi.run(jax.random.PRNGKey(0), 5, *data(n=12), progress_bar=False, init_params=start)
    assert runs == [None, None]  # not asked: nb.fit has no init_params


def test_end_of_run_warnings_point_at_the_callers_line():
    x, y = data()
    with jax.enable_x64(True), warnings.catch_warnings(record=True) as caught:  # the program of the tests above
        warnings.simplefilter("always")
        SVI(regression, AutoNormal(regression), nb.BLR(), Trace_ELBO()).run(jax.random.PRNGKey(0), 5, x, y=y,
                                                                           progress_bar=False)
    short = [w for w in caught if "too short to judge" in str(w.message)]
    assert short and all(w.filename == __file__ for w in short), [(w.filename, str(w.message)[:60]) for w in caught]

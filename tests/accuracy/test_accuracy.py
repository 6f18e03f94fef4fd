"""Accuracy targets on real data, against independent references (NUTS, Adam run to convergence)."""

import jax
import numpy as np
import numpyro
import pytest
from conftest import logistic_model
from numpyro.diagnostics import effective_sample_size
from numpyro.infer import SVI, Trace_ELBO
from numpyro.infer.autoguide import AutoMultivariateNormal

import numpyro_blr as nb

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def nuts_reference(breast_cancer_nuts):
    # conftest.py: 2 chains x (500 warmup, 1500 draws), shared with test_diagnostics.py
    w = np.asarray(breast_cancer_nuts.get_samples(group_by_chain=True)["w"])  # (chains, draws, 31)
    ess = effective_sample_size(w)
    flat = w.reshape(-1, w.shape[-1])
    return flat.mean(0), flat.std(0), ess


def _elbo(params, guide, X, y):
    # common random numbers: the same key for every fit compared
    return -Trace_ELBO(num_particles=2000).loss(jax.random.PRNGKey(7), params, logistic_model, guide, X, y)


def test_blr_full_gaussian_matches_nuts(breast_cancer, nuts_reference):
    """Target: posterior means within 0.05 NUTS-sd and sds within 0.9-1.1x NUTS's.

    The comparison carries NUTS's own Monte Carlo error: its mean has standard error sd/sqrt(ESS),
    so the mean tolerance is 0.05 + 3 SE/sd; an sd estimated from ESS draws has relative error
    about 1/sqrt(2 ESS), which widens the sd band by three of those.
    """
    X, y = breast_cancer
    nuts_mean, nuts_sd, ess = nuts_reference
    guide = AutoMultivariateNormal(logistic_model)
    result = SVI(logistic_model, guide, nb.BLR(), Trace_ELBO()).run(jax.random.PRNGKey(0), 1000, X, y, progress_bar=False)
    mean = np.asarray(result.params["auto_loc"])
    tril = np.asarray(result.params["auto_scale_tril"])
    sd = np.sqrt(np.sum(tril**2, axis=1))
    mean_err = np.abs(mean - nuts_mean) / nuts_sd
    assert np.all(mean_err <= 0.05 + 3 / np.sqrt(ess)), (mean_err.max(), (3 / np.sqrt(ess)).max())
    ratio = sd / nuts_sd
    widen = 3 / np.sqrt(2 * ess)
    assert np.all((ratio >= 0.9 - widen) & (ratio <= 1.1 + widen)), (ratio.min(), ratio.max())


def test_blr_reaches_adam_elbo_in_50_steps(breast_cancer):
    """Target: nb.BLR() with defaults is within 1 nat of Adam(0.01)'s converged ELBO after <= 50 steps."""
    X, y = breast_cancer
    adam_guide = AutoMultivariateNormal(logistic_model)
    adam = SVI(logistic_model, adam_guide, numpyro.optim.Adam(0.01), Trace_ELBO()).run(
        jax.random.PRNGKey(0), 3000, X, y, progress_bar=False
    )
    blr_guide = AutoMultivariateNormal(logistic_model)
    blr = SVI(logistic_model, blr_guide, nb.BLR(), Trace_ELBO()).run(jax.random.PRNGKey(0), 50, X, y, progress_bar=False)
    adam_elbo = _elbo(adam.params, adam_guide, X, y)
    blr_elbo = _elbo(blr.params, blr_guide, X, y)
    assert blr_elbo >= adam_elbo - 1.0, (float(blr_elbo), float(adam_elbo))

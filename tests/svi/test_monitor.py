"""numpyro_blr.monitor: ELBO curves with common random numbers, steps_to_reach, and timing helpers."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.infer import SVI, Trace_ELBO
from numpyro.infer.autoguide import AutoNormal

import numpyro_blr as nb
from numpyro_blr.monitor import ELBOCurve, elbo_curve, steps_to_reach, time_per_step_alternating

Y = jnp.array([0.3, -1.2, 0.8, 2.1, 0.4])


def model(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    with numpyro.plate("n", y.shape[0]):
        numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)


@pytest.mark.slow
def test_elbo_curve_matches_a_direct_evaluation_and_steps_to_reach():
    svi = SVI(model, AutoNormal(model), nb.BLR(), Trace_ELBO())
    key = jax.random.PRNGKey(7)
    curve = elbo_curve(svi, jax.random.PRNGKey(0), 30, Y, checkpoints=[0, 15, 30], num_particles=100, eval_key=key)
    assert list(curve.steps) == [0, 15, 30]
    direct = -Trace_ELBO(num_particles=100).loss(key, curve.params, model, svi.guide, Y)
    np.testing.assert_allclose(curve.elbo[-1], direct, rtol=1e-5)
    # conjugate model: at the exact posterior log p - log q is constant, so every particle gives the
    # log evidence; the BLR (exact Hessian, control-variate gradient) contracts geometrically to it
    n = Y.shape[0]
    log_evidence = dist.MultivariateNormal(jnp.zeros(n), jnp.eye(n) + jnp.ones((n, n))).log_prob(Y)
    assert abs(curve.elbo[-1] - log_evidence) < 0.05
    toy = ELBOCurve(np.array([0, 10, 20]), np.array([-10.0, -2.5, -1.2]), {}, None)
    assert steps_to_reach(toy, -1.0) == 20 and steps_to_reach(toy, -1.0, tol=2.0) == 10
    assert steps_to_reach(toy, 5.0) is None


@pytest.mark.slow
def test_time_per_step_alternating_returns_one_positive_time_per_svi():
    svis = [SVI(model, AutoNormal(model), opt, Trace_ELBO()) for opt in (numpyro.optim.Adam(0.01), nb.BLR())]
    secs = time_per_step_alternating(svis, jax.random.PRNGKey(0), Y, num_steps=20, rounds=2)
    assert len(secs) == 2 and all(np.isfinite(s) and s > 0 for s in secs)

"""nb.BLR() under ``Trace_ELBO(num_particles=K)``: the exact-Hessian estimate's control variate needs the
sample's offset z - m, which a loss averaged over K particles does not give (solving the averaged Hessian
against the averaged Hessian-times-offset weighs each particle's offset by its curvature). The control
variate is left out there, and the fixed point is the mean-field optimum's."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.infer import Trace_ELBO
from numpyro.infer.autoguide import AutoNormal
from scipy.optimize import minimize

import numpyro_blr as nb
from numpyro_blr.estimators.svi import loss_particles

Y = np.array([2.0, 5.0, 3.0, 1.0, 4.0])


def poisson_model(y):
    a = numpyro.sample("a", dist.Normal(0.0, 3.0))
    numpyro.sample("y", dist.Poisson(jnp.exp(a)), obs=y)


def optimum():
    """The KL-optimal N(m, s^2) in closed form: E_q[log p] = sum(y) m - n e^{m + s^2/2} - (m^2 + s^2)/18 + const."""
    def neg_elbo(v):
        m, log_s = v
        s2 = np.exp(2 * log_s)
        return -(Y.sum() * m - len(Y) * np.exp(m + s2 / 2) - (m * m + s2) / 18 + log_s)

    m, log_s = minimize(neg_elbo, [1.0, -1.0], method="BFGS", options={"gtol": 1e-10}).x
    return m, np.exp(log_s)


def test_loss_particles_reads_the_elbo_of_svi_update():
    """The loss function SVI.update gives the optimizer (numpyro.infer.svi._make_loss_fn) closes over the ELBO."""
    from numpyro.infer.svi import _make_loss_fn

    guide = AutoNormal(poisson_model)
    for k in (1, 3):
        fn = _make_loss_fn(Trace_ELBO(num_particles=k), jax.random.PRNGKey(0), lambda p: p, poisson_model, guide, (Y,),
                           {}, {})
        assert loss_particles(fn) == k
    assert loss_particles(lambda p: 0.0) == 1


@pytest.mark.slow  # five fits of 1,000 steps: ~5 s cold
def test_several_particles_reach_the_mean_field_optimum():
    """Five seeds, 1,000 steps, 4 particles: the mean's error is zero within five standard errors of the
    seeds' spread (with the control variate it was 0.183-0.193 sd on every seed, a standard error of 0.0015)."""
    m, s = optimum()
    errors = []
    for seed in range(5):
        guide = AutoNormal(poisson_model)
        res = nb.fit(poisson_model, guide, Y, num_steps=1000, progress_bar=False, rng_key=jax.random.PRNGKey(seed),
                     loss=Trace_ELBO(num_particles=4))
        errors.append((float(res.params["a_auto_loc"]) - m) / s)
    errors = np.array(errors)
    se = errors.std(ddof=1) / np.sqrt(len(errors))
    assert abs(errors.mean()) < 5 * se + 1e-3, errors

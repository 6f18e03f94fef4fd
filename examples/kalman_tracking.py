"""Kalman filtering and smoothing as BLR steps on NumPyro ``scan`` models (``numpyro_blr.online.kalman``).

1. A constant-velocity target in 2-d (state: position and velocity, 4-d) observed through noisy positions,
   written as an ordinary NumPyro model with ``numpyro.contrib.control_flow.scan``. The filter (one BLR
   step with rho = 1 per time step: the Kalman update) and the Rauch-Tung-Striebel smoother: position RMSE
   of the raw observations, the filtered and the smoothed means; the marginal log-likelihood against
   dynamax's Kalman filter (if dynamax is installed).
2. A latent log-intensity observed through Poisson counts: the smoothed marginals of the iterated Laplace
   (exact Hessian, 5 Newton steps per time) and of the variational BLR step (Gauss-Hermite expectations)
   against a NUTS run on the same model.

Run: python examples/kalman_tracking.py
"""

import time

import jax

jax.config.update("jax_enable_x64", True)  # the filter matches dynamax to ~1e-10 in float64

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import numpyro  # noqa: E402
import numpyro.distributions as dist  # noqa: E402
from numpyro.contrib.control_flow import scan  # noqa: E402
from numpyro.infer import MCMC, NUTS  # noqa: E402

from numpyro_blr.online.kalman import kalman_smoother  # noqa: E402

# ------------------------------------------------------------------ 1. constant-velocity tracking
DT, T = 0.1, 200
F = np.eye(4) + DT * np.eye(4, k=2)  # (px, py, vx, vy)
Q = 0.5 * np.kron(np.array([[DT ** 3 / 3, DT ** 2 / 2], [DT ** 2 / 2, DT]]), np.eye(2))
H = np.eye(2, 4)
R = 0.5 ** 2 * np.eye(2)
M0, P0 = np.array([0.0, 0.0, 1.0, 0.5]), np.diag([1.0, 1.0, 0.5, 0.5])


def tracking_model(y):
    x0 = numpyro.sample("x0", dist.MultivariateNormal(M0, P0))

    def step(x_prev, y_t):
        x = numpyro.sample("x", dist.MultivariateNormal(F @ x_prev, Q))
        numpyro.sample("y", dist.MultivariateNormal(H @ x, R), obs=y_t)
        return x, None

    scan(step, x0, y)


rng = np.random.default_rng(0)
x = rng.multivariate_normal(M0, P0)
xs, ys = [], []
for _ in range(T):
    x = F @ x + rng.multivariate_normal(np.zeros(4), Q)
    xs.append(x)
    ys.append(H @ x + rng.multivariate_normal(np.zeros(2), R))
xs, ys = np.array(xs), jnp.asarray(np.array(ys))

t0 = time.perf_counter()
res = kalman_smoother(tracking_model, ys)
secs = time.perf_counter() - t0


def rmse(a):
    return float(np.sqrt(np.mean(np.sum((np.asarray(a)[:, :2] - xs[:, :2]) ** 2, axis=1))))


print(f"1. constant-velocity tracking, T = {T}, 4-d state, noisy 2-d positions ({secs:.1f} s incl. compile)")
print(f"   position RMSE: raw observations {rmse(ys):.4f}   filtered {rmse(res.filtered_means):.4f}"
      f"   smoothed {rmse(res.smoothed_means):.4f}")
print(f"   marginal log-likelihood (BLR, rho = 1): {float(res.marginal_loglik):.10f}")
try:
    from dynamax.linear_gaussian_ssm.inference import lgssm_filter, make_lgssm_params

    params = make_lgssm_params(F @ M0, F @ P0 @ F.T + Q, F, Q, H, R)
    ref = lgssm_filter(params, ys)
    print(f"   marginal log-likelihood (dynamax):      {float(ref.marginal_loglik):.10f}   "
          f"(difference {float(res.marginal_loglik - ref.marginal_loglik):.1e}; dynamax adds 1e-9 to the diagonal"
          " of each matrix it solves with)")
    print(f"   max |filtered mean - dynamax's| {float(jnp.max(jnp.abs(res.filtered_means - ref.filtered_means))):.1e}")
except ImportError:
    print("   (dynamax not installed: no comparison)")

# ------------------------------------------------------------------ 2. Poisson counts vs NUTS
TP = 40


def count_model(y):
    x0 = numpyro.sample("x0", dist.Normal(0.0, 1.0))

    def step(x_prev, y_t):
        x = numpyro.sample("x", dist.Normal(0.9 * x_prev, 0.3))
        numpyro.sample("y", dist.Poisson(jnp.exp(x + 1.0)), obs=y_t)
        return x, None

    scan(step, x0, y)


rng = np.random.default_rng(1)
x, lam, counts = rng.normal(), [], []
for _ in range(TP):
    x = 0.9 * x + 0.3 * rng.normal()
    lam.append(x)
    counts.append(rng.poisson(np.exp(x + 1.0)))
counts = jnp.asarray(np.array(counts, float))

t0 = time.perf_counter()
laplace = kalman_smoother(count_model, counts, num_iter=5)
t_lap = time.perf_counter() - t0
t0 = time.perf_counter()
vb = kalman_smoother(count_model, counts, expectation="gauss_hermite", order=20, num_iter=5)
t_vb = time.perf_counter() - t0
t0 = time.perf_counter()
mcmc = MCMC(NUTS(count_model), num_warmup=1000, num_samples=2000, progress_bar=False)
mcmc.run(jax.random.PRNGKey(0), counts)
t_nuts = time.perf_counter() - t0
draws = np.asarray(mcmc.get_samples()["x"])
ref_m, ref_s = draws.mean(0), draws.std(0)

print(f"\n2. Poisson counts, log-rate = latent AR(1), T = {TP}: smoothed marginals vs NUTS (1000 + 2000 draws)")
print(f"   {'method':<34}{'time':>7}{'max |mean-NUTS|/sd':>20}{'sd / NUTS sd':>16}{'loglik':>10}")
for name, r, secs in (("iterated Laplace (num_iter=5)", laplace, t_lap),
                      ("variational (Gauss-Hermite, 20)", vb, t_vb)):
    m, s = np.asarray(r.smoothed_means[:, 0]), np.sqrt(np.asarray(r.smoothed_covariances[:, 0, 0]))
    print(f"   {name:<34}{secs:>6.1f}s{np.max(np.abs(m - ref_m) / ref_s):>20.3f}"
          f"{(s / ref_s).min():>9.3f}-{(s / ref_s).max():.3f}{float(r.marginal_loglik):>10.3f}")
print(f"   {'NUTS':<34}{t_nuts:>6.1f}s")

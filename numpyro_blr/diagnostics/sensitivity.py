r"""Memory perturbation: sensitivity to each example and leave-one-out without refitting.

Nickl, Xu, Tailor, Möllenhoff & Khan (2023), *The memory-perturbation equation: understanding model's
sensitivity to data* (NeurIPS). For a model with outputs :math:`f_i(\theta)` and a loss
:math:`\ell_i = -\log p(y_i \mid f_i)` fitted with a Gaussian posterior
:math:`q = \mathcal N(m, \Sigma)` (the BLR's, a Laplace approximation's, any Gaussian guide's),
removing example :math:`i` moves the natural parameters of :math:`q` by that example's
contribution. For a generalised linear model (or a linearised network) this gives, at :math:`m`:

.. math::
    J_i = \nabla_\theta f_i(m), \qquad
    e_i = \nabla_f \ell_i(f_i) \ (\text{prediction error}), \qquad
    \Lambda_i = \nabla^2_f \ell_i(f_i) \ (\text{noise precision}), \qquad
    v_i = J_i \Sigma J_i^\top \ (\text{prediction variance}),

.. math::
    m_{\setminus i} - m \approx \Sigma J_i^\top e_i, \qquad
    f_i^{\setminus i} \approx f_i + v_i\, e_i, \qquad
    \text{sensitivity}_i = \Lambda_i\, v_i\, \lvert e_i\rvert

(Nickl et al. 2023, Sec. 3.2 and eq. 12: prediction error times prediction variance). With
``rank_one=True`` the covariance is downdated by the removed example first (Sherman-Morrison,
:math:`\Sigma_{\setminus i} = (\Sigma^{-1} - J_i^\top\Lambda_i J_i)^{-1}`), which gives
:math:`v_i^{\setminus i} = v_i / (1 - \Lambda_i v_i)`; for a Laplace posterior this is one exact
Newton step of the refit without example :math:`i`.

For a Bernoulli-logit model :math:`e_i = \sigma(f_i) - y_i`, :math:`\Lambda_i = \sigma(f_i)(1-\sigma(f_i))`;
Gaussian: :math:`e_i = (f_i - y_i)/s^2`, :math:`\Lambda_i = 1/s^2`; Poisson-log:
:math:`e_i = e^{f_i} - y_i`, :math:`\Lambda_i = e^{f_i}`.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["LIKELIHOODS", "MemoryPerturbation", "gaussian_from_params", "memory_perturbation"]


def _bernoulli(f, y, noise):
    p = jax.nn.sigmoid(f)
    return p - y, p * (1 - p)


def _gaussian(f, y, noise):
    return (f - y) / noise**2, jnp.full_like(f, 1.0 / noise**2)


def _poisson(f, y, noise):
    mu = jnp.exp(f)
    return mu - y, mu


LIKELIHOODS = {"bernoulli": _bernoulli, "normal": _gaussian, "gaussian": _gaussian, "poisson": _poisson}


class MemoryPerturbation(NamedTuple):
    """Per-example quantities of the memory-perturbation equation (all shape ``(N,)``).

    ``f`` outputs at the posterior mean; ``residual`` :math:`e_i`; ``precision`` :math:`\\Lambda_i`;
    ``variance`` :math:`v_i = J_i\\Sigma J_i^\\top`; ``sensitivity`` :math:`\\Lambda_i v_i |e_i|`;
    ``loo_f`` the leave-one-out output estimate :math:`f_i + v_i e_i` (or with the rank-one
    downdate); ``loo_shift`` ``loo_f - f``; ``loo_prob`` the leave-one-out predictive mean
    (:math:`\\sigma(f^{\\setminus i}_i)` for Bernoulli, :math:`e^{f}` Poisson, :math:`f` Gaussian).
    """

    f: np.ndarray
    residual: np.ndarray
    precision: np.ndarray
    variance: np.ndarray
    sensitivity: np.ndarray
    loo_f: np.ndarray
    loo_shift: np.ndarray
    loo_prob: np.ndarray


def gaussian_from_params(params, site=None, prefix="auto"):
    r"""Mean :math:`m` and covariance :math:`\Sigma` of a Gaussian guide's (unconstrained) latent.

    ``params`` are ``svi_result.params`` (constrained, as ``SVI.get_params`` returns them):
    ``AutoMultivariateNormal`` (``auto_loc``, ``auto_scale_tril``: :math:`\Sigma = LL^\top`),
    ``AutoLowRankMultivariateNormal`` (:math:`WW^\top + \mathrm{diag}(s^2)`),
    ``AutoDiagonalNormal`` (``auto_loc``, ``auto_scale``) or ``AutoNormal``
    (``{site}_auto_loc``, ``{site}_auto_scale``; ``site`` may be a name or a list of names,
    concatenated in that order; default: the only site).
    """
    loc = f"{prefix}_loc"
    if loc in params:
        m = jnp.asarray(params[loc])
        if f"{prefix}_scale_tril" in params:
            L = jnp.asarray(params[f"{prefix}_scale_tril"])
            return m, L @ L.T
        if f"{prefix}_cov_factor" in params:
            W = jnp.asarray(params[f"{prefix}_cov_factor"])
            s = jnp.asarray(params[f"{prefix}_scale"])
            return m, W @ W.T + jnp.diag(s**2)
        if f"{prefix}_scale" in params:
            return m, jnp.diag(jnp.asarray(params[f"{prefix}_scale"]) ** 2)
        raise ValueError(
            f"params have {loc!r} but no '{prefix}_scale_tril', '{prefix}_scale' or '{prefix}_cov_factor': "
            "a point mass (AutoDelta/AutoLaplaceApproximation params) has no covariance; pass cov= yourself."
        )
    suffix = f"_{prefix}_loc"
    sites = sorted(k[: -len(suffix)] for k in params if k.endswith(suffix))
    if site is None:
        if len(sites) != 1:
            raise ValueError(f"params hold the Gaussian sites {sites}; say which with site=... (a name or a list).")
        site = sites
    names = [site] if isinstance(site, str) else list(site)
    for n in names:
        if f"{n}{suffix}" not in params or f"{n}_{prefix}_scale" not in params:
            raise ValueError(f"params have no Gaussian for the site {n!r} (expected '{n}{suffix}' and '{n}_{prefix}_scale').")
    m = jnp.concatenate([jnp.ravel(params[f"{n}{suffix}"]) for n in names])
    s = jnp.concatenate([jnp.ravel(params[f"{n}_{prefix}_scale"]) for n in names])
    return m, jnp.diag(s**2)


def memory_perturbation(
    mean, cov, y, X=None, predict_fn=None, likelihood="bernoulli", noise=1.0, rank_one=False
):
    r"""Per-example sensitivity and leave-one-out outputs from a Gaussian posterior (Nickl et al. 2023).

    :param mean: posterior mean :math:`m`, shape ``(D,)``.
    :param cov: posterior covariance :math:`\Sigma`, ``(D, D)`` (or ``(D,)`` for a diagonal).
    :param y: targets, ``(N,)``.
    :param X: design matrix ``(N, D)`` of a GLM, :math:`f = X\theta` (so :math:`J_i = x_i`).
    :param predict_fn: instead of ``X``, a function :math:`\theta \mapsto f` of shape ``(N,)``;
        :math:`J = \partial f/\partial\theta` by ``jax.jacfwd`` at the mean (the linearised model).
    :param likelihood: ``"bernoulli"`` (logit link), ``"gaussian"`` (identity; noise sd ``noise``) or
        ``"poisson"`` (log link).
    :param rank_one: downdate :math:`\Sigma` by the removed example (Sherman-Morrison) before the
        leave-one-out step: :math:`v_i \to v_i/(1-\Lambda_i v_i)`.
    :returns: :class:`MemoryPerturbation` with :math:`e_i, \Lambda_i, v_i = J_i\Sigma J_i^\top`,
        sensitivity :math:`\Lambda_i v_i |e_i|` and :math:`f_i^{\setminus i} \approx f_i + v_i e_i`.
    """
    if likelihood not in LIKELIHOODS:
        raise ValueError(f"likelihood must be one of {sorted(LIKELIHOODS)}, got {likelihood!r}.")
    if (X is None) == (predict_fn is None):
        raise ValueError("pass exactly one of X (a GLM design matrix) or predict_fn (theta -> outputs).")
    mean = jnp.asarray(mean)
    cov = jnp.asarray(cov)
    if cov.ndim == 1:
        cov = jnp.diag(cov)
    D = mean.shape[-1]
    if mean.ndim != 1 or cov.shape != (D, D):
        raise ValueError(f"mean must be (D,) and cov (D, D); got {mean.shape} and {cov.shape}.")
    if X is not None:
        J = jnp.asarray(X)
        if J.ndim != 2 or J.shape[1] != D:
            raise ValueError(f"X must be (N, {D}) to match the mean, got {J.shape}.")
        f = J @ mean
    else:
        f = jnp.asarray(predict_fn(mean))
        J = jax.jacfwd(predict_fn)(mean).reshape(f.shape[0], D)
    y = jnp.asarray(y, dtype=f.dtype)
    if y.shape != f.shape:
        raise ValueError(f"y has shape {y.shape} but the outputs have shape {f.shape}.")
    e, lam = LIKELIHOODS[likelihood](f, y, noise)
    v = jnp.einsum("nd,de,ne->n", J, cov, J)
    v_loo = v / (1.0 - lam * v) if rank_one else v
    loo_f = f + v_loo * e
    if likelihood == "bernoulli":
        loo_prob = jax.nn.sigmoid(loo_f)
    elif likelihood == "poisson":
        loo_prob = jnp.exp(loo_f)
    else:
        loo_prob = loo_f
    out = MemoryPerturbation(f, e, lam, v, lam * v * jnp.abs(e), loo_f, loo_f - f, loo_prob)
    return MemoryPerturbation(*(np.asarray(a) for a in out))

r"""The Bayesian learning rule for a Gaussian, written on its precision and mean.

For :math:`q = \mathcal{N}(m, S^{-1})` and loss :math:`\ell` (minus the log joint), the BLR
:math:`\lambda \leftarrow (1-\rho)\lambda - \rho \nabla_\mu \mathbb{E}_q[\ell]` reads
(Khan & Rue 2023, eq. 11)

.. math::
    S &\leftarrow S + \rho\, G, \qquad G = \hat H - S, \\
    m &\leftarrow m - \rho\, S_{\text{new}}^{-1} \hat g,

with :math:`\hat g \approx \mathbb{E}_q[\nabla\ell]` and :math:`\hat H \approx \mathbb{E}_q[\nabla^2\ell]`
(the prior is part of :math:`\ell`). The improved BLR (Lin, Schmidt & Khan 2020, "Handling the
positive-definite constraint in the Bayesian learning rule", eq. 8) adds a second-order term
that keeps :math:`S` positive definite for *any* symmetric :math:`\hat H` and any :math:`\rho > 0`:

.. math::
    S \leftarrow S + \rho\, G + \tfrac{\rho^2}{2}\, G S^{-1} G
      = \tfrac12 S + \tfrac12 (S + \rho G) S^{-1} (S + \rho G) \succ 0.

The diagonal version is the same elementwise (it is IVON's Hessian update, Shen et al. 2024).

In whitened coordinates (:math:`S = I`, :math:`M` the whitened :math:`\hat H`) each eigenvalue
:math:`b` of :math:`B = (1-\rho) I + \rho M` becomes :math:`k(b)` in the new precision
:math:`K`; three positivity rules (``POSITIVITY``) differ only in :math:`k`:

* ``"plain"``: :math:`k = b` (Khan & Rue 2023, eq. 11; not positive when :math:`b \le 0`);
* ``"improved"``: :math:`k = (1 + b^2)/2` (Lin, Schmidt & Khan 2020), positive, but
  :math:`k \approx b^2/2 \gg b` when the estimate is far above the current precision: one step
  from an initial precision :math:`S` to a curvature :math:`H \gg S` gives
  :math:`\tfrac{\rho^2}{2} H^2/S`, an over-shoot by :math:`\rho^2 H/(2S)`;
* ``"one-sided"`` (the default of :class:`numpyro_blr.BLR`), elementwise for diagonal guides:
  :math:`k = b` where :math:`b \ge 1` (the precision grows: the plain step, a convex combination,
  cannot over-shoot) and :math:`k = (1+b^2)/2` where :math:`b < 1` (the precision shrinks: the
  improved step, which keeps :math:`k \ge 1/2`). Both branches have value 1 and slope 1 at
  :math:`b = 1`, so :math:`k` is continuously differentiable, a first-order retraction like the
  improved rule, with the same fixed point :math:`M = I`. For a full precision the split by
  eigenvalue would need an eigendecomposition, which XLA runs 15-30 times slower than a Cholesky
  on CPU (0.3-0.5 ms at :math:`D = 31`); the full rule is instead :math:`K = B` when
  :math:`B \succeq I/2` (one more Cholesky tells) and the improved :math:`K = (I + B^2)/2`
  otherwise. Both keep :math:`K \succeq I/2`; they differ from the eigenvalue split only on
  eigenvalues in :math:`[1/2, 1)` (plain there) and, in a step where some eigenvalue is below
  :math:`1/2` (negative curvature), on the others (improved there).

:func:`gaussian_update` is the whole step (precision, then mean) for one Gaussian or, ``vmap``-ed,
for the components of a mixture. Families whose natural parameters are unconstrained (Bernoulli,
Categorical) need no positivity rule: :func:`natural_update` is their step, with a prior and momentum.
"""

import jax.numpy as jnp
from jax import lax
from jax.scipy.linalg import cho_solve, solve_triangular

from numpyro_blr.families.gaussian import precision_to_scale_tril, scale_tril_to_precision


POSITIVITY = ("one-sided", "improved", "plain")


def positivity_rule(improved):
    """The rule's name from :class:`~numpyro_blr.BLR`'s ``improved`` (``True``, ``False`` or a name)."""
    if improved is True:
        return "improved"
    if improved is False:
        return "plain"
    if improved in POSITIVITY:
        return improved
    raise ValueError(f"improved must be True, False or one of {POSITIVITY}, got {improved!r}.")


def whitened_retraction(b, improved="one-sided"):
    """:math:`k(b)` of the module docstring, elementwise (``b`` a whitened diagonal or eigenvalues)."""
    rule = positivity_rule(improved)
    if rule == "plain":
        return b
    curved = 0.5 * (1.0 + b * b)
    return curved if rule == "improved" else jnp.where(b >= 1.0, b, curved)


def diagonal_precision_update(precision, hess, lr, improved=True):
    """One BLR step on a diagonal precision (elementwise); positive for any ``hess`` unless ``improved=False``.

    The improved step is evaluated as ``p/2 + b^2/(2p)`` with ``b = (1 - lr) p + lr hess``, a sum
    of non-negative terms, so it stays ``>= p/2`` in floating point as well; the one-sided rule
    takes ``b`` itself where ``b >= p``.
    """
    rule = positivity_rule(improved)
    b = (1.0 - lr) * precision + lr * hess  # = precision + lr * g, exact at lr = 1
    if rule == "plain":
        return b
    curved = 0.5 * precision + 0.5 * b * b / precision
    return curved if rule == "improved" else jnp.where(b >= precision, b, curved)


def improved_precision_factor(chol_precision, hess, lr):
    r"""``F`` with :math:`F F^\top = S + \rho G + \tfrac{\rho^2}{2} G S^{-1} G`, from :math:`S = R R^\top`.

    With :math:`B = S + \rho G`, the improved update equals :math:`\tfrac12 R R^\top + \tfrac12 (B R^{-\top})(B R^{-\top})^\top`,
    so :math:`F = [R,\ B R^{-\top}]/\sqrt2` has full row rank (it contains :math:`R`) whatever :math:`\hat H` is.
    """
    precision = chol_precision @ chol_precision.T
    b = (1.0 - lr) * precision + lr * hess
    r_inv = solve_triangular(chol_precision, jnp.eye(precision.shape[-1], dtype=precision.dtype), lower=True)
    return jnp.concatenate([chol_precision, b @ r_inv.T], axis=-1) / jnp.sqrt(2.0).astype(precision.dtype)


def full_precision_update(precision, covariance, hess, lr, improved=True):
    """One BLR step on a dense precision ``S`` given its inverse ``covariance``; PD when ``improved``.

    The improved step is formed as the Gram matrix ``F F^T`` of :func:`improved_precision_factor`, which is
    positive definite by construction (no cancellation between the terms).
    """
    del covariance  # the factorised form needs only a Cholesky factor of S
    rule = positivity_rule(improved)
    if rule == "one-sided":
        new_tril = full_scale_tril_update(precision_to_scale_tril(precision), hess, lr, rule)
        return scale_tril_to_precision(new_tril)
    if rule == "improved":
        f = improved_precision_factor(jnp.linalg.cholesky(precision), hess, lr)
        new = f @ f.T
    else:
        new = (1.0 - lr) * precision + lr * hess  # = precision + lr * g, exact at lr = 1
    return 0.5 * (new + new.T)


def gaussian_update(mean, precision, grad, hess, lr, improved=True):
    r"""The whole step of the module docstring, :math:`S` then :math:`m \leftarrow m - \rho S_{\rm new}^{-1}\hat g`:
    ``(mean, precision)`` for a diagonal (shaped like ``mean``) or dense ``precision``. The dense improved
    :math:`S_{\rm new} = F F^\top` (:func:`improved_precision_factor`) is never factorised: its Cholesky
    factor is read off a QR of :math:`F^\top`; the other rules factorise :math:`S_{\rm new}` (NaN if not PD).
    """
    if jnp.ndim(precision) == jnp.ndim(mean):
        new = diagonal_precision_update(precision, hess, lr, improved)
        return mean - lr * grad / new, new
    if positivity_rule(improved) == "improved":
        f = improved_precision_factor(jnp.linalg.cholesky(precision), hess, lr)
        r = jnp.linalg.qr(f.T, mode="r")
        chol = (r * jnp.sign(jnp.diagonal(r))[:, None]).T  # F F^T = chol chol^T
        new = f @ f.T
        new = 0.5 * (new + new.T)
    else:
        new = full_precision_update(precision, None, hess, lr, improved)
        chol = jnp.linalg.cholesky(new)
    return mean - lr * cho_solve((chol, True), grad), new


def inverse_scale_tril(scale_tril):
    r""":math:`L^{-1}` (lower triangular): with it the precision is :math:`S = L^{-\top}L^{-1}` and
    every solve with :math:`L` or :math:`L^\top` in a BLR step becomes a matrix product."""
    eye = jnp.eye(scale_tril.shape[-1], dtype=scale_tril.dtype)
    return solve_triangular(scale_tril, eye, lower=True)


def _scale_tril_from_factor_qr(f):
    """:math:`L` with :math:`(L L^\top)^{-1} = F F^\top`, by a QR decomposition of :math:`(J F)^\top`."""
    u = jnp.linalg.qr(jnp.flip(f, axis=0).T, mode="r")
    u = u * jnp.sign(jnp.diagonal(u))[:, None]
    eye = jnp.eye(f.shape[0], dtype=f.dtype)
    return jnp.flip(solve_triangular(u, eye, lower=False), axis=(0, 1))


def full_scale_tril_update(scale_tril, hess, lr, improved=True, whitened_hess=None):
    r"""The BLR precision step carried out on the covariance's Cholesky factor :math:`L` (:math:`S = L^{-\top}L^{-1}`).

    Returns the new :math:`L`. In whitened coordinates, :math:`M = L^\top\hat H L` and
    :math:`S = L^{-\top} I L^{-1}`, so every precision of the step is :math:`L^{-\top} K L^{-1}`:
    plain :math:`K = \tilde B = (1-\rho) I + \rho M` (:math:`S + \rho G`), improved
    (:math:`S + \rho G + \frac{\rho^2}{2} G S^{-1} G`, Lin, Schmidt & Khan 2020)
    :math:`K = \tfrac12 (I + \tilde B^2)`, whose eigenvalues are :math:`\ge \tfrac12`: positive
    definite for any :math:`\hat H` and :math:`\rho`. Then :math:`\Sigma_{\rm new} = L K^{-1} L^\top`
    and :math:`L_{\rm new} = L T` with :math:`T` the lower Cholesky factor of :math:`K^{-1}`
    (:func:`~numpyro_blr.families.gaussian.precision_to_scale_tril`: one Cholesky, one triangular
    inverse; no inverse of :math:`L`). Should that Cholesky fail or lose accuracy in floating point
    (condition number of :math:`K` beyond about :math:`10^{-3}/\varepsilon`), a factor :math:`F` with
    :math:`K = F F^\top` is triangularised by a QR decomposition instead, which does not square the
    condition number: :math:`F = [I, \tilde B]/\sqrt2` for the improved step, :math:`[C, I/\sqrt2]`
    with :math:`C C^\top = \tilde B - I/2` for the one-sided rule's plain branch. The plain step is
    non-finite when :math:`\tilde B` is not positive definite.
    ``whitened_hess`` (:math:`M`, when the estimator gives it) replaces ``hess``.
    """
    if whitened_hess is None:
        m = scale_tril.T @ hess @ scale_tril
        m = 0.5 * (m + m.T)
    else:
        m = whitened_hess
    rule = positivity_rule(improved)
    eye = jnp.eye(scale_tril.shape[-1], dtype=scale_tril.dtype)
    b = (1.0 - lr) * eye + lr * m
    if rule == "plain":
        return _times_inverse_cholesky_factor(scale_tril, b)
    half = jnp.sqrt(0.5).astype(scale_tril.dtype)
    k, factor = 0.5 * (eye + b @ b), jnp.concatenate([eye, b], axis=-1) * half  # K = F F^T
    if rule == "one-sided":  # B itself where B >= I/2, told by a Cholesky C C^T = B - I/2
        c = jnp.linalg.cholesky(b - 0.5 * eye)
        grows = jnp.all(jnp.isfinite(c))
        k = jnp.where(grows, b, k)
        factor = jnp.where(grows, jnp.concatenate([jnp.where(grows, c, 0.0), eye * half], axis=-1), factor)
    w = _flipped_cholesky(k)
    d = jnp.abs(jnp.diagonal(w))
    # Cholesky's relative error is about cond(K) eps, and cond(K) >= (max d / min d)^2: past
    # cond(K) ~ 1e-3/eps (1e4 in float32) the QR route, which does not square it, takes over
    accurate = jnp.all(jnp.isfinite(w)) & (jnp.min(d) ** 2 > 1e3 * jnp.finfo(d.dtype).eps * jnp.max(d) ** 2)
    return lax.cond(
        accurate,
        lambda _: _solve_with_flipped_cholesky(scale_tril, w),
        lambda _: scale_tril @ _scale_tril_from_factor_qr(factor),
        None,
    )


def _flipped_cholesky(k):
    r"""Upper-triangular :math:`W` with :math:`K = W W^\top`: :math:`J K J = V V^\top`, :math:`W = J V J`."""
    return jnp.flip(jnp.linalg.cholesky(jnp.flip(k, axis=(-2, -1))), axis=(-2, -1))


def _solve_with_flipped_cholesky(scale_tril, w):
    r""":math:`L W^{-\top}`, the factor :math:`L T` of :func:`_times_inverse_cholesky_factor`."""
    return lax.linalg.triangular_solve(w, scale_tril, left_side=False, lower=False, transpose_a=True)


def _times_inverse_cholesky_factor(scale_tril, k):
    r""":math:`L T` with :math:`T` the lower Cholesky factor of :math:`K^{-1}`, by one Cholesky and one
    triangular solve: with the reversal :math:`J`, :math:`J K J = V V^\top` and :math:`W = J V J` (upper),
    :math:`K = W W^\top` so :math:`T = W^{-\top}` and :math:`L T` solves :math:`X W^\top = L`
    (as :func:`~numpyro_blr.families.gaussian.precision_to_scale_tril`, without forming :math:`T`)."""
    return _solve_with_flipped_cholesky(scale_tril, _flipped_cholesky(k))


def momentum_update(momentum, grad, beta, step):
    r"""Heavy-ball momentum as an exponential average with bias correction.

    ``momentum <- beta momentum + (1 - beta) grad``; returns the new momentum and
    ``momentum / (1 - beta^step)`` (``step`` counts from 1). ``beta = 0`` returns ``grad``.
    """
    if isinstance(beta, (int, float)) and beta == 0.0:  # a static 0: no arithmetic at all
        return grad, grad
    new = beta * momentum + (1.0 - beta) * grad
    corrected = new / (1.0 - jnp.asarray(beta, new.dtype) ** step)
    return new, corrected


def natural_update(lam, momentum, grad, prior_lam, lr, beta, step, reweight=1.0):
    r"""The BLR on an unconstrained natural parameter :math:`\lambda` with prior :math:`\lambda_0` and momentum
    (BayesBiNN, Meng et al. 2020): :func:`momentum_update` of :math:`\hat g + \kappa(\lambda - \lambda_0)`, then
    :math:`\lambda \leftarrow \lambda - \rho\,\bar m/(1 - \beta^t)`. :math:`\hat g \approx \nabla_\mu \mathbb E_q[\ell]`
    (likelihood only; the conjugate prior's KL term contributes :math:`\lambda - \lambda_0`), :math:`\kappa` =
    ``reweight`` (1: the BLR; with :math:`\beta = 0`, :math:`\lambda \leftarrow (1-\rho)\lambda + \rho\lambda_0 - \rho\hat g`).
    Elementwise; returns ``(lam, momentum)``.
    """
    mom, corrected = momentum_update(momentum, grad + reweight * (lam - prior_lam), beta, step)
    return (lam - lr * corrected).astype(lam.dtype), mom

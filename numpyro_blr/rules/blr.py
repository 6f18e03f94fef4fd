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
"""

import jax.numpy as jnp
from jax.scipy.linalg import solve_triangular

from numpyro_blr.families.gaussian import precision_to_scale_tril, scale_tril_to_precision


def diagonal_precision_update(precision, hess, lr, improved=True):
    """One BLR step on a diagonal precision (elementwise); positive for any ``hess`` when ``improved``.

    The improved step is evaluated as ``p/2 + b^2/(2p)`` with ``b = (1 - lr) p + lr hess``, a sum
    of non-negative terms, so it stays ``>= p/2`` in floating point as well.
    """
    b = (1.0 - lr) * precision + lr * hess  # = precision + lr * g, exact at lr = 1
    if improved:
        return 0.5 * precision + 0.5 * b * b / precision
    return b


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
    if improved:
        f = improved_precision_factor(jnp.linalg.cholesky(precision), hess, lr)
        new = f @ f.T
    else:
        new = (1.0 - lr) * precision + lr * hess  # = precision + lr * g, exact at lr = 1
    return 0.5 * (new + new.T)


def full_scale_tril_update(scale_tril, hess, lr, improved=True):
    r"""The BLR precision step carried out on the covariance's Cholesky factor :math:`L` (:math:`S = L^{-\top}L^{-1}`).

    Returns the new :math:`L`. Improved: with :math:`R = L^{-\top}` (so :math:`R R^\top = S` and
    :math:`R^{-\top} = L`), :math:`F = [R,\ B L]/\sqrt2` is a factor of the new precision (as in
    :func:`improved_precision_factor`); it is triangularised by a QR decomposition, and the new
    :math:`L` is read off without forming or inverting :math:`S_{\rm new}`:
    with :math:`J` the reversal, :math:`(J F)^\top = Q U` gives :math:`S_{\rm new} = J U^\top U J` and
    :math:`L_{\rm new} = J U^{-1} J`. Plain: :math:`S_{\rm new} = (1-\rho)S + \rho\hat H` and its
    Cholesky (non-finite if that is not positive definite).
    """
    if not improved:
        new = (1.0 - lr) * scale_tril_to_precision(scale_tril) + lr * hess
        return precision_to_scale_tril(0.5 * (new + new.T))
    d = scale_tril.shape[-1]
    eye = jnp.eye(d, dtype=scale_tril.dtype)
    l_inv = solve_triangular(scale_tril, eye, lower=True)  # S = l_inv^T l_inv
    # F = [R, B R^-T]/sqrt2 holds for any square R with R R^T = S; R = l_inv^T gives R^-T = L
    precision = l_inv.T @ l_inv
    b = (1.0 - lr) * precision + lr * hess
    f = jnp.concatenate([l_inv.T, b @ scale_tril], axis=-1) / jnp.sqrt(2.0).astype(scale_tril.dtype)
    _, u = jnp.linalg.qr(jnp.flip(f, axis=0).T)
    u = u * jnp.sign(jnp.diagonal(u))[:, None]
    u_inv = solve_triangular(u, eye, lower=False)
    return jnp.flip(u_inv, axis=(0, 1))


def momentum_update(momentum, grad, beta, step):
    r"""Heavy-ball momentum as an exponential average with bias correction.

    ``momentum <- beta momentum + (1 - beta) grad``; returns the new momentum and
    ``momentum / (1 - beta^step)`` (``step`` counts from 1). ``beta = 0`` returns ``grad``.
    """
    new = beta * momentum + (1.0 - beta) * grad
    corrected = new / (1.0 - jnp.asarray(beta, new.dtype) ** step)
    return new, corrected

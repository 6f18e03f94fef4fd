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


def diagonal_precision_update(precision, hess, lr, improved=True):
    """One BLR step on a diagonal precision (elementwise); positive for any ``hess`` when ``improved``."""
    g = hess - precision
    new = precision + lr * g
    if improved:
        new = new + 0.5 * lr**2 * g * g / precision
    return new


def full_precision_update(precision, covariance, hess, lr, improved=True):
    """One BLR step on a dense precision ``S`` given its inverse ``covariance``; PD when ``improved``."""
    g = hess - precision
    new = precision + lr * g
    if improved:
        new = new + 0.5 * lr**2 * (g @ covariance @ g)
    return 0.5 * (new + new.T)


def momentum_update(momentum, grad, beta, step):
    r"""Heavy-ball momentum as an exponential average with bias correction.

    ``momentum <- beta momentum + (1 - beta) grad``; returns the new momentum and
    ``momentum / (1 - beta^step)`` (``step`` counts from 1). ``beta = 0`` returns ``grad``.
    """
    new = beta * momentum + (1.0 - beta) * grad
    corrected = new / (1.0 - jnp.asarray(beta, new.dtype) ** step)
    return new, corrected

r"""Table 1 of Khan & Rue (2023), optimisation rows, as compositions of :class:`~numpyro_blr.BLR`.

============================  ==========================  ===============================
algorithm                     posterior family            natural-gradient approximation
============================  ==========================  ===============================
:func:`gradient_descent`      Gaussian, fixed covariance  delta method
:func:`newton`                Gaussian (full)             delta method, exact Hessian
:func:`laplace`               Gaussian (full)             Newton to the mode, ``lr = 1``
:func:`von`                   Gaussian                    sampled Hessian (Price), improved BLR
============================  ==========================  ===============================
"""

from numpyro_blr.optim import BLR


def gradient_descent(lr=0.01, momentum=0.0, **kwargs):
    r"""Gradient descent :math:`m \leftarrow m - \rho \nabla\ell(m)` (Khan & Rue 2023, Sec. 1.3).

    BLR with a Gaussian of fixed covariance (identity precision) and the delta method; the
    guide's scale is left untouched. With ``momentum`` it is heavy-ball gradient descent. The step
    is taken as given (``backtrack=False``: no damping of steps that raise the loss), as in the
    classic algorithm.
    """
    kwargs.setdefault("backtrack", False)
    return BLR(lr, hessian="none", delta=True, momentum=momentum, **kwargs)


def newton(lr=1.0, improved=False, **kwargs):
    r"""Newton's method :math:`S \leftarrow (1-\rho)S + \rho\nabla^2\ell(m)`, :math:`m \leftarrow m - \rho S^{-1}\nabla\ell(m)`.

    BLR with a full Gaussian, the delta method and the exact Hessian (Khan & Rue 2023, eq. 13).
    With ``lr=1`` it is Newton's method, and on a quadratic loss (a conjugate Gaussian model) one
    step gives the exact posterior mean and covariance. The plain BLR is used (``improved=False``)
    so that this holds; a step whose Hessian is not positive definite is then skipped as
    non-finite: pass ``improved=True`` to keep it positive definite instead.
    """
    return BLR(lr, hessian="autodiff", delta=True, improved=improved, **kwargs)


def laplace(**kwargs):
    r"""The Laplace approximation: Newton's method (``lr=1``) to the mode, covariance :math:`\nabla^2\ell(m)^{-1}`.

    With ``AutoMultivariateNormal`` the guide holds :math:`\mathcal{N}(m^*, \nabla^2\ell(m^*)^{-1})` once
    the iterations converge (a few steps for log-concave posteriors), which is NumPyro's
    ``AutoLaplaceApproximation`` computed by the BLR. Unlike :func:`newton` it uses the improved
    BLR by default: far from the mode (saturated logits, say) an undamped Newton step can jump
    away, while the improved step is damped there by its extra term
    :math:`\tfrac{\rho^2}{2} G S^{-1} G`, which vanishes at the fixed point
    :math:`S = \nabla^2\ell(m^*)`, so the converged approximation is the same.
    """
    kwargs.setdefault("lr", 1.0)
    kwargs.setdefault("improved", True)
    return newton(**kwargs)


def von(lr=0.1, momentum=0.0, **kwargs):
    r"""Variational online Newton (Khan et al. 2018; Khan & Rue 2023, eq. 12).

    :math:`S \leftarrow (1-\rho)S + \rho\,\hat H`, :math:`m \leftarrow m - \rho S^{-1}\hat g` with
    :math:`\hat g, \hat H` from one sample of the guide (Price's theorem), and the improved-BLR
    correction that keeps :math:`S` positive definite: ``nb.BLR(lr, hessian="reparam")``.
    """
    return BLR(lr, hessian="reparam", delta=False, momentum=momentum, **kwargs)

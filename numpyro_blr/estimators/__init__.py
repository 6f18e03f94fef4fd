r"""How the BLR reads :math:`\nabla_\mu \mathbb E_q[\ell]`: every estimator returns an :class:`Estimate`.

Khan & Rue (2023), Table 1: an algorithm is a posterior family, a natural-gradient
approximation (this package) and the update rule (:mod:`numpyro_blr.rules`). For a Gaussian
:math:`q = \mathcal N(m, S^{-1})`, :math:`\nabla_\mu \mathbb E_q[\ell]` is carried by the pair
:math:`(\mathbb E_q[\nabla\ell], \mathbb E_q[\nabla^2\ell])` (Bonnet's and Price's theorems,
Sec. 4.2 of the paper): ``grad`` and ``hessian`` of the :class:`Estimate`. For every other family
``grad`` holds :math:`\nabla_\mu \mathbb E_q[\ell]` itself, in the family's expectation-parameter
NamedTuple, and ``hessian`` is None.

Modules:

==========================  ================================================================
:mod:`.svi`                 Gaussian blocks of a NumPyro guide, from SVI's ELBO loss: Price /
                            reparameterisation (``"reparam"``, ``"price"``), Hutchinson's
                            diagonal (``"hutchinson"``), exact Hessian (``"autodiff"``), delta
                            method (``delta=True``), none
:mod:`.mixture`             mixture of Gaussians, per component: responsibility-weighted Monte
                            Carlo (``reparam``, exact or Price Hessian), delta method at the
                            means (``delta``); ``grad`` a ``MixtureGrad(means, logits)``
:mod:`.relaxation`          :math:`\pm1` Bernoulli weights: Gumbel-softmax / Concrete
                            relaxation (BayesBiNN); ``grad`` a pytree like the weights
:mod:`.implicit`            Gamma / Beta / Dirichlet sites: the implicit-reparameterisation
                            path derivative (no score term) mapped to :math:`\nabla_\mu` by
                            :math:`J^{-\top}`, the entropy's gradient :math:`\lambda` in closed form
:mod:`.discrete`            Bernoulli / Categorical sites: enumeration (local expectation
                            gradients), score function with a leave-one-out baseline
:mod:`.weights`             diagonal Gaussian over a network's weights: Price with weight noise
                            (IVON), per-example Gauss-Newton (VOGN, OGN), squared gradient
                            (Adam, RMSprop), gradient (SGD), sharpness-aware (bSAM)
==========================  ================================================================

Names used across the package (one per concept): ``precision`` :math:`S` (a Gaussian's natural
parameter, never "curv"/"hess"/"nat2"); ``hessian`` an estimate of :math:`\mathbb E_q[\nabla^2\ell]`;
``grad`` an estimate of :math:`\mathbb E_q[\nabla\ell]` (or :math:`\nabla_\mu` for other families);
``lr`` / :math:`\rho` the BLR step size; ``radius`` bSAM's neighbourhood size; ``weight_decay`` a
Gaussian prior's precision per example; ``delta`` the delta method (evaluate at the mean). The
``hessian=`` choices of ``nb.BLR``: ``"reparam"`` is Price's theorem in its reparameterisation
form, :math:`\hat H = \operatorname{sym}(\nabla_L \hat\ell\,\varepsilon^{-1})` read from the
gradient w.r.t. the scale, with the same draw's baseline subtracted (two gradient passes, low
variance); ``"price"`` is the one-pass form :math:`\hat H = S(z-m)\hat g^\top` symmetrised;
``"hutchinson"`` the diagonal of the exact Hessian at the sample from one whitened Rademacher probe per
block, :math:`\hat h_i = v_i[\nabla^2\ell(z)(s\odot v)]_i/s_i` (one forward-over-reverse pass; full blocks take
``"reparam"``); ``"autodiff"`` the exact Hessian at the sample (forward-over-reverse); ``"none"`` keeps the
covariance (gradient descent on the mean).
"""

from typing import Any, NamedTuple, Optional

import jax


class Estimate(NamedTuple):
    r"""What every estimator returns.

    ``loss``      the value of the loss the estimate read (NaN when it read none);
    ``grad``      Gaussian families: :math:`\hat g \approx \mathbb E_q[\nabla\ell]`, shaped like the mean
                  (a flat vector, an array or a pytree); other families:
                  :math:`\nabla_\mu \mathbb E_q[\ell]`, shaped like the family's expectation parameters;
    ``hessian``   Gaussian families: :math:`\hat H \approx \mathbb E_q[\nabla^2\ell]` (shaped like the mean
                  for a diagonal family, a dense matrix for a full one); None when not estimated;
    ``check``     None, or a scalar that is finite iff the estimate is (0 or NaN:
                  :func:`~numpyro_blr.tree.finite_check` of the gradient it was formed from), for a rule that skips
                  non-finite steps, when the estimator can tell more cheaply than a pass over ``grad`` and
                  ``hessian`` (IVON's curvature is formed from the gradient and noise the update recomputes).
    """

    loss: jax.Array
    grad: Any
    hessian: Optional[Any] = None
    check: Optional[jax.Array] = None


from numpyro_blr.estimators.svi import (  # noqa: E402
    HESSIANS,
    at_mean,
    estimate,
    hoist_constant_work,
    hutchinson_diagonal,
    reparam_hessian_diagonal,
    reparam_hessian_full,
    reparam_whitened_hessian,
    sample_control,
    sample_offset,
)

__all__ = [
    "Estimate",
    "HESSIANS",
    "at_mean",
    "estimate",
    "hoist_constant_work",
    "hutchinson_diagonal",
    "reparam_hessian_diagonal",
    "reparam_hessian_full",
    "reparam_whitened_hessian",
    "sample_control",
    "sample_offset",
]

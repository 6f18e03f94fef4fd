r"""Online Bayes as the Bayesian learning rule: the posterior as the next prior.

Khan & Rue (2023) write Bayes' rule for a stream of data as the BLR with :math:`\rho = 1`: the posterior after
batch :math:`t` is the prior of batch :math:`t+1`, and with a conjugate likelihood one step is exact. This
subpackage builds on that:

- :mod:`~numpyro_blr.online.prior`: any fitted guide (Gaussian autoguides, ``ExpFamilyGuide``, conjugate and
  message-passing results) as the prior of the next batch of the same NumPyro model.
- :mod:`~numpyro_blr.online.kalman`: Kalman filtering and smoothing as BLR steps on state-space models written
  with ``numpyro.contrib.control_flow.scan``.
- :mod:`~numpyro_blr.online.merge`: model merging by uncertainty (precision-weighted task vectors).

Continual learning for networks (a diagonal posterior as the next task's prior) is an option of the
deep-learning rows: ``nb.ivon(..., prior=...)``.
"""

from numpyro_blr.online.kalman import KalmanResult, StateSpaceModelError, kalman_filter, kalman_smoother
from numpyro_blr.online.merge import gaussian_product, merge, posterior_precision, task_arithmetic
from numpyro_blr.online.prior import PRIOR_FACTOR, Prior, PriorError, as_prior, with_prior
from numpyro_blr.online.stream import BatchReport, Stream

__all__ = [
    "BatchReport",
    "KalmanResult",
    "PRIOR_FACTOR",
    "Prior",
    "PriorError",
    "StateSpaceModelError",
    "Stream",
    "as_prior",
    "gaussian_product",
    "kalman_filter",
    "kalman_smoother",
    "merge",
    "posterior_precision",
    "task_arithmetic",
    "with_prior",
]

r"""The BLR step of one non-Gaussian :class:`numpyro_blr.guides.ExpFamilyGuide` site: an estimator of
:math:`\nabla_\mu\mathbb E_q[\ell]` followed by the family's ``blr_update`` (Khan & Rue 2023, eq. 11),

.. math::
    \lambda \leftarrow \lambda - \rho\,\nabla_\mu \mathcal L = (1-\rho)\lambda - \rho\,\nabla_\mu \mathbb E_q[\ell],

with the improved-BLR retraction (Lin, Schmidt & Khan 2020) keeping the parameters valid. Gamma, Beta
and Dirichlet sites are read by :mod:`numpyro_blr.estimators.implicit` (from SVI's gradient, which the
guide makes a score-free path derivative), Bernoulli and Categorical sites by
:mod:`numpyro_blr.estimators.discrete` (enumeration, or the score function above ``max_enumerate`` loss
evaluations).
"""

from numpyro_blr.estimators import discrete, implicit
from numpyro_blr.estimators.discrete import MAX_ENUMERATE, SCORE_SAMPLES
from numpyro_blr.families.registry import FAMILIES

__all__ = ["MAX_ENUMERATE", "MAX_STEP", "SCORE_SAMPLES", "from_natural_parameters", "natural_parameters", "update_block"]

#: Trust region of one step of a Gamma, Beta or Dirichlet site: the step size is shrunk per element
#: so that no positive parameter changes by more than this fraction of itself to first order
#: (:func:`numpyro_blr.families.dirichlet.trusted_step`; the retraction then keeps it in
#: :math:`[\theta/2, 5\theta/2]`). Without it one single-sample estimate far from the optimum could
#: ask for a concentration 1e3-1e6 times too large (a Beta site of NumPyro's enumeration example
#: with 10,000 observations reached 4e16 and a float32 loss of -3.5e11 in five steps).
MAX_STEP = 1.0


def update_block(block, fn, params, grads, lr, improved, key=None, max_enumerate=None, score_samples=SCORE_SAMPLES):
    """New raw parameters ``{name: value}`` of one EXPFAM block (:class:`numpyro_blr.layout.ExpFamBlock`)
    after a BLR step; ``fn(params) -> (loss, aux)`` is SVI's loss and ``grads`` its gradient."""
    info = FAMILIES[block.family]
    raw = tuple(params[n] for n in block.names)
    if info.discrete:
        est = discrete.estimate(info.family, fn, params, block.loc, key, max_enumerate, score_samples)
    else:
        est = implicit.estimate(info, raw, tuple(grads[n] for n in block.names))
    natural = info.family.to_natural(*info.constrain(raw))
    new = info.unconstrain(info.user(info.family.blr_update(natural, est.grad, lr, improved, max_step=MAX_STEP)))
    return {n: v.astype(params[n].dtype) for n, v in zip(block.names, new)}


def natural_parameters(block, params):
    """The natural parameters of one EXPFAM block (the family's natural NamedTuple, one field per raw
    parameter of the block) from the raw parameters ``params``: what ``nb.BLR``'s iterate average holds."""
    info = FAMILIES[block.family]
    return info.family.to_natural(*info.constrain(tuple(params[n] for n in block.names)))


def from_natural_parameters(block, natural, params):
    """Raw parameters ``{name: value}`` of one EXPFAM block from its natural parameters (a sequence in the
    order of the family's natural NamedTuple), in the dtypes of ``params``."""
    info = FAMILIES[block.family]
    new = info.unconstrain(info.user(info.family.Natural(*natural)))
    return {n: v.astype(params[n].dtype) for n, v in zip(block.names, new)}

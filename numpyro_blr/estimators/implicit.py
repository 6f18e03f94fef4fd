r""":math:`\nabla_\mu \mathbb E_q[\ell]` of a Gamma, Beta or Dirichlet site from the implicit-reparameterisation gradient.

SVI's loss is evaluated at one implicitly reparameterised sample (NumPyro's samplers,
``Trace_ELBO``), so its gradient w.r.t. the guide's raw parameters :math:`\theta` (log-parameters)
is an unbiased estimate of :math:`\nabla_\theta\mathcal L`, :math:`\mathcal L = \mathbb E_q[\ell] - \mathcal H(q)`.
By the chain rule :math:`\nabla_\theta\mathcal L = J^\top \nabla_\mu\mathcal L` with
:math:`J = \partial\mu/\partial\theta` (per element for Gamma/Beta, a :math:`K\times K` block per
Dirichlet; :math:`J` is the Fisher matrix times :math:`\partial\lambda/\partial\theta`, invertible), so
:math:`\nabla_\mu\mathcal L = J^{-\top}\nabla_\theta\mathcal L` is solved exactly, block by block, and
:math:`\nabla_\mu\mathbb E_q[\ell] = \nabla_\mu\mathcal L - \lambda` (base measure 1).
"""

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_blr.estimators import Estimate


def estimate(info, raw, grad_raw):
    r""":class:`Estimate` of :math:`\nabla_\mu\mathbb E_q[\ell]` (``grad``, the family's expectation
    NamedTuple) for the registry row ``info`` (:mod:`numpyro_blr.families.registry`), from the raw
    parameters ``raw`` (tuple, in the order of ``info.params``) and SVI's gradient ``grad_raw`` w.r.t. them."""
    fam = info.family
    sizes = [r.shape[-1] if info.event_dim else 1 for r in raw]  # raw values per element and parameter
    n = raw[0].size // sizes[0]
    cuts = list(np.cumsum(sizes)[:-1])

    def stack(xs):  # per-element vectors (n, sum(sizes)), and back
        return jnp.concatenate([x.reshape(n, k) for x, k in zip(xs, sizes)], -1)

    def unstack(v):
        return tuple(p.reshape(x.shape) for p, x in zip(jnp.split(v, cuts, -1), raw))

    def mu_of_raw(v):  # the expectation parameters of one element, from its raw parameters
        one = [p if info.event_dim else p[0] for p in jnp.split(v, cuts)]
        mu = fam.expectation(fam.to_natural(*info.constrain(one)))
        return jnp.concatenate([jnp.reshape(m, (-1,)) for m in mu])

    jac = jax.vmap(jax.jacfwd(mu_of_raw))(stack(raw))  # (n, d, d): d mu / d raw
    grad_mu_total = jnp.linalg.solve(jnp.swapaxes(jac, -1, -2), stack(grad_raw)[..., None])[..., 0]
    natural = fam.to_natural(*info.constrain(raw))
    grad = fam.Expectation(*[g - lam for g, lam in zip(unstack(grad_mu_total), natural)])
    return Estimate(jnp.asarray(jnp.nan, grad_mu_total.dtype), grad)

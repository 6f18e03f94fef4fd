r""":math:`\nabla_\mu \mathbb E_q[\ell]` of a Bernoulli or Categorical guide site, from loss evaluations.

``Trace_ELBO`` gives no useful gradient for a non-reparameterisable site, so the loss ``fn(params)``
(SVI's, at the step's fixed key) is evaluated with the site set to chosen values, every other latent
keeping its sample. A value is set **through the parameters**, with no state outside them: the
site's logits are replaced, for the chosen elements, by *certain* logits (:func:`certain_logits`:
:math:`\pm 10^4` for a Bernoulli, :math:`0` for the chosen category and :math:`-10^4` for the others),
under which NumPyro's draw is that value for any key while the other elements' draws are unchanged
(``jax.random.bernoulli`` compares elementwise uniforms with :math:`\sigma(\lambda)`,
``jax.random.categorical`` takes the argmax of logits plus elementwise Gumbel noise), and their
:math:`\log q` is exactly 0 in floating point (:math:`\mathrm{softplus}(10^4) = 10^4`,
:math:`e^{-10^4} = 0`). The loss so evaluated is therefore exactly :math:`\ell` = loss minus the
chosen elements' :math:`\log q` under the guide's own logits, the quantity both estimators need.

* **Enumeration** (local expectation gradients, Titsias & Lázaro-Gredilla 2015): each element
  :math:`j` is set to each of its :math:`K` values; with :math:`\ell_{jk}` the loss so evaluated,
  :math:`\partial\mathbb E_q[\ell]/\partial\mu_{jk} = \ell_{jk} - \ell_{j,K-1}` (Categorical,
  :math:`\mu = p_{0..K-2}`) and :math:`\ell_{j1} - \ell_{j0}` (Bernoulli, :math:`\mu = p`); unbiased,
  and exact in the site itself. :math:`\sum_j K_j` evaluations, batched with ``jax.vmap``.
* **Score function** with a leave-one-out baseline (Kool, van Hoof & Welling 2019), for sites larger
  than ``max_enumerate`` evaluations: :math:`S` draws :math:`z_s\sim q` of the whole site, :math:`\ell_s`
  the loss at :math:`z_s`, :math:`T` the sufficient statistics, :math:`F = \mathrm{Cov}_q[T]`:

  .. math::
      \widehat{\nabla_\mu\mathbb E_q[\ell]} = \frac{1}{S-1}\sum_s (\ell_s - \bar\ell)\,F^{-1}(T(z_s) - \mu),

  unbiased because each :math:`z_s` is independent of its baseline :math:`\frac{1}{S-1}\sum_{s'\ne s}\ell_{s'}`.
  :math:`F^{-1}(T - \mu)` is :math:`z/p - (1-z)/(1-p)` per Bernoulli element and
  :math:`1[z=k]/p_k - 1[z=K-1]/p_{K-1}` per Categorical element, computed from the logits
  (:math:`1/p = 1 + e^{-\lambda}`) so that it stays finite in float32. Its variance grows with the
  site's size (every element's estimate sees the whole site's loss); the BLR's decaying step size
  averages it out.

The estimators take the family class (:class:`~numpyro_blr.families.Bernoulli` or
:class:`~numpyro_blr.families.Categorical`), the loss ``fn(params) -> (loss, aux)``, the parameters and
the name of the site's logits in them.
"""

import jax
import jax.numpy as jnp

from numpyro_blr.estimators import Estimate
from numpyro_blr.families import Bernoulli

MAX_ENUMERATE = 64
SCORE_SAMPLES = 32
CERTAIN = 1e4  # |logit| of a certain value: sigmoid(1e4) == 1 and softplus(1e4) == 1e4 in float32 and float64


def certain_logits(family, value, num_categories=2):
    """Logits under which a draw is ``value`` (an integer array) with probability 1 in floating point."""
    if family is Bernoulli:
        return jnp.where(jnp.asarray(value) != 0, CERTAIN, -CERTAIN)
    return jnp.where(jnp.arange(num_categories) == jnp.asarray(value)[..., None], 0.0, -CERTAIN)


def enumeration_size(family, logits):
    """Loss evaluations needed to enumerate the site element by element (``sum_j K_j``)."""
    return logits.size * (2 if family is Bernoulli else 1)


def _per_element(family, logits):
    """``(rows, k)``: the site's logits one element per row, and its number of values."""
    if family is Bernoulli:
        return logits.reshape(-1), 2
    return logits.reshape(-1, logits.shape[-1]), logits.shape[-1]


def enumerated_losses(family, fn, params, name):
    r""":math:`\ell_{jk}` (shape ``(elements, K)``): the loss with element :math:`j` of the site set to
    :math:`k`, without that element's :math:`\log q` (module docstring)."""
    logits = params[name]
    rows, k = _per_element(family, logits)
    n = rows.shape[0]

    def loss_at(j, v):
        forced = rows.at[j].set(certain_logits(family, v, k).astype(rows.dtype)).reshape(logits.shape)
        return fn({**params, name: forced})[0]

    return jax.vmap(loss_at)(jnp.repeat(jnp.arange(n), k), jnp.tile(jnp.arange(k), n)).reshape(n, k)


def enumeration(family, fn, params, name):
    r""":class:`Estimate` of :math:`\nabla_\mu\mathbb E_q[\ell]` by enumerating the site element by element."""
    logits = params[name]
    ell = enumerated_losses(family, fn, params, name)
    if family is Bernoulli:
        grad = (ell[:, 1] - ell[:, 0]).reshape(logits.shape)
    else:
        grad = (ell[:, :-1] - ell[:, -1:]).reshape(logits.shape[:-1] + (ell.shape[1] - 1,))
    return Estimate(jnp.asarray(jnp.nan, logits.dtype), family.Expectation(grad))


def score_function(family, fn, params, name, key, num_samples=SCORE_SAMPLES):
    r""":class:`Estimate` of :math:`\nabla_\mu\mathbb E_q[\ell]` by the score-function estimator with a
    leave-one-out baseline from ``num_samples`` draws of the whole site (module docstring), written as
    :math:`\frac{1}{S-1}\sum_s(\ell_s-\bar\ell)\,w(z_s)` with :math:`w = F^{-1}(T(z) - \mu)`."""
    if num_samples < 2:
        raise ValueError(f"the score-function estimator needs at least 2 samples, got {num_samples}.")
    logits = params[name]
    if family is Bernoulli:
        z = jax.random.bernoulli(key, jax.nn.sigmoid(logits), (num_samples,) + logits.shape)
        w = jnp.where(z, 1.0 + jnp.exp(-logits), -(1.0 + jnp.exp(logits)))
        k = 2
    else:
        k = logits.shape[-1]
        z = jax.random.categorical(key, logits, shape=(num_samples,) + logits.shape[:-1])
        onehot = jax.nn.one_hot(z, k, dtype=bool)
        inv_p = jnp.where(onehot, jnp.exp(-jax.nn.log_softmax(logits, -1)), 0.0)  # 1[z=k] / p_k
        w = inv_p[..., :-1] - inv_p[..., -1:]

    def loss_at(value):
        return fn({**params, name: certain_logits(family, value, k).astype(logits.dtype)})[0]

    ell = jax.vmap(loss_at)(z)
    centred = (ell - jnp.mean(ell)).astype(logits.dtype)
    grad = jnp.tensordot(centred, w.astype(logits.dtype), axes=1) / (num_samples - 1)
    return Estimate(jnp.asarray(jnp.nan, logits.dtype), family.Expectation(grad))


def estimate(family, fn, params, name, key=None, max_enumerate=MAX_ENUMERATE, score_samples=SCORE_SAMPLES):
    r""":class:`Estimate` of :math:`\nabla_\mu\mathbb E_q[\ell]` of a discrete site: enumerated when that
    needs at most ``max_enumerate`` loss evaluations (``None``: always), otherwise the score-function
    estimator with ``score_samples`` draws from ``key``."""
    size = enumeration_size(family, params[name])
    if max_enumerate is None or size <= max_enumerate:
        return enumeration(family, fn, params, name)
    if key is None:
        raise ValueError(
            f"the discrete site with parameter {name!r} needs {size} > max_enumerate={max_enumerate} loss "
            "evaluations to enumerate; the score-function estimator used instead needs a random key."
        )
    return score_function(family, fn, params, name, key, score_samples)

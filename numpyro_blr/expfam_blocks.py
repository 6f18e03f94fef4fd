r"""BLR updates for the non-Gaussian sites of :class:`numpyro_blr.guides.ExpFamilyGuide`.

For a site with exponential-family guide :math:`q_\lambda` the BLR (Khan & Rue 2023, eq. 11) is

.. math::
    \lambda \leftarrow \lambda - \rho\,\nabla_\mu \mathcal L
            = (1-\rho)\lambda - \rho\,\nabla_\mu \mathbb E_q[\ell],

where :math:`\mathcal L = \mathbb E_q[\ell] - \mathcal H(q)` is the ELBO loss and
:math:`\nabla_\mu(-\mathcal H) = \lambda` (every family here has base measure 1). The family's
``blr_update(natural, grad_mu, lr, improved)`` takes :math:`\nabla_\mu \mathbb E_q[\ell]` and keeps
the parameters valid (improved BLR, Lin, Schmidt & Khan 2020) without clipping.

How :math:`\nabla_\mu` is obtained:

* **Gamma, Beta, Dirichlet** (continuous): SVI's loss is evaluated at one implicitly
  reparameterised sample (``Trace_ELBO``), so its gradient w.r.t. the guide's raw (log-)parameters
  :math:`\theta` is an unbiased estimate of :math:`\nabla_\theta\mathcal L`. By the chain rule
  :math:`\nabla_\theta\mathcal L = J^\top \nabla_\mu\mathcal L` with :math:`J = \partial\mu/\partial\theta`
  (per element for Gamma/Beta, a :math:`K\times K` block per Dirichlet; :math:`J` is the Fisher matrix
  times :math:`\partial\lambda/\partial\theta`, invertible), so
  :math:`\nabla_\mu\mathcal L = J^{-\top}\nabla_\theta\mathcal L` is solved exactly, block by block,
  and :math:`\nabla_\mu\mathbb E_q[\ell] = \nabla_\mu\mathcal L - \lambda`.
* **Bernoulli, Categorical** (discrete): ``Trace_ELBO`` gives no useful gradient for a
  non-reparameterisable site, so the optimizer **enumerates** it: each element :math:`j` of the site is
  set to each of its :math:`K` values while every other latent keeps its sample (local expectation
  gradients, Titsias & Lázaro-Gredilla 2015). With :math:`\ell_{jk}` the loss at value :math:`k`
  minus :math:`\log q_j(k)`, :math:`\partial\mathbb E_q[\ell]/\partial\mu_{jk} = \ell_{jk} - \ell_{j,K-1}`
  (Categorical, :math:`\mu = p_{0..K-2}`) and :math:`\ell_{j1} - \ell_{j0}` (Bernoulli,
  :math:`\mu = p`); unbiased, and exact in the site itself. The evaluations are batched with
  ``jax.vmap``; a site costs :math:`\sum_j K_j` loss evaluations and is enumerated only when that
  is at most ``max_enumerate`` (``ExpFamilyGuide(max_enumerate=64)`` by default).
* **Larger discrete sites**: the score-function (REINFORCE) estimator with a leave-one-out baseline
  (Kool, van Hoof & Welling 2019). :math:`S` = ``score_samples`` values :math:`z_s\sim q` of the whole
  site are drawn (every other latent keeps its sample), :math:`\ell_s` is the loss at :math:`z_s` minus
  :math:`\log q(z_s)`, and with :math:`T` the sufficient statistics and :math:`F = \mathrm{Cov}_q[T]`

  .. math::
      \widehat{\nabla_\lambda\mathbb E_q[\ell]} = \frac{1}{S-1}\sum_s (\ell_s - \bar\ell)\,(T(z_s) - \mu),
      \qquad \widehat{\nabla_\mu\mathbb E_q[\ell]} = F^{-1}\widehat{\nabla_\lambda\mathbb E_q[\ell]},

  unbiased because each :math:`z_s` is independent of the baseline :math:`\frac{1}{S-1}\sum_{s'\ne s}\ell_{s'}`
  (the sum above is that estimator rewritten). :math:`F^{-1}` is explicit:
  :math:`1/(p(1-p))` per Bernoulli element, :math:`\mathrm{diag}(1/p_{:K-1}) + 11^\top/p_K` per
  Categorical element. Its variance grows with the number of elements of the site (every element's
  estimate sees the whole site's loss), so it needs more steps than enumeration; the BLR's decaying
  step size averages it out.
"""

import contextlib
import threading

import jax
import jax.numpy as jnp
from numpyro.distributions import constraints
from numpyro.distributions.transforms import biject_to

from numpyro_blr.families import Bernoulli, Beta, Categorical, Dirichlet, Gamma

FAMILIES = {"gamma": Gamma, "beta": Beta, "dirichlet": Dirichlet, "bernoulli": Bernoulli, "categorical": Categorical}
DISCRETE = ("bernoulli", "categorical")
MAX_ENUMERATE = 64
SCORE_SAMPLES = 32

# the raw <-> user transform of each family's parameters (what SVI's constrain_fn applies)
PARAM_CONSTRAINT = {
    "gamma": constraints.positive,
    "beta": constraints.positive,
    "dirichlet": constraints.positive,
    "bernoulli": constraints.real,
    "categorical": constraints.real,
}

# -- forcing the value of one element of a discrete site (used by the guide) ------------------
_LOCAL = threading.local()


def forced_value(param_name):
    """``(flat_index, value)`` if the optimizer is enumerating the site whose logits are ``param_name``."""
    return getattr(_LOCAL, "forced", {}).get(param_name)


@contextlib.contextmanager
def force(param_name, index, value):
    """While active, the guide sets element ``index`` (flat) of the site whose logits are
    ``param_name`` to ``value``; ``index=None`` sets the whole site to ``value``."""
    old = getattr(_LOCAL, "forced", {})
    _LOCAL.forced = {**old, param_name: (index, value)}
    try:
        yield
    finally:
        _LOCAL.forced = old


# -- continuous families ------------------------------------------------------------------------
def _user(family, raw):
    """User parameters (tuple) from raw values."""
    t = biject_to(PARAM_CONSTRAINT[family])
    return tuple(t(r) for r in raw)


def _raw(family, user):
    t = biject_to(PARAM_CONSTRAINT[family])
    return tuple(t.inv(u) for u in user)


def _elementwise(family, raw):
    """Stack raw parameters into per-element vectors ``(n, d)`` and back."""
    if family == "dirichlet":
        (r,) = raw
        shape = r.shape
        return r.reshape(-1, shape[-1]), lambda v: (v.reshape(shape),)
    shape = raw[0].shape
    stacked = jnp.stack([r.reshape(-1) for r in raw], -1)
    return stacked, lambda v: tuple(v[:, i].reshape(shape) for i in range(v.shape[-1]))


def _mu_of_raw_vector(family):
    fam = FAMILIES[family]

    def f(v):
        if family == "dirichlet":
            nat = fam.to_natural(jnp.exp(v))
        else:
            nat = fam.to_natural(*[jnp.exp(v[i]) for i in range(v.shape[0])])
        return jnp.stack([jnp.reshape(m, (-1,)) for m in fam.expectation(nat)], 0).reshape(-1)

    return f


def grad_mu_continuous(family, raw, grad_raw):
    r""":math:`\nabla_\mu\mathcal L` from the gradient w.r.t. the raw parameters (exact block solves)."""
    v, unstack = _elementwise(family, raw)
    g, _ = _elementwise(family, grad_raw)
    jac = jax.vmap(jax.jacfwd(_mu_of_raw_vector(family)))(v)  # (n, d, d): d mu / d raw
    gm = jnp.linalg.solve(jnp.swapaxes(jac, -1, -2), g[..., None])[..., 0]
    return unstack(gm)


def update_continuous(family, raw, grad_raw, lr, improved):
    fam = FAMILIES[family]
    user = _user(family, raw)
    nat = fam.to_natural(*user)
    grad_mu_total = grad_mu_continuous(family, raw, grad_raw)
    grad_mu_loss = fam.Expectation(*[gm - lam for gm, lam in zip(grad_mu_total, nat)])
    new_nat = fam.blr_update(nat, grad_mu_loss, lr, improved)
    new_user = fam.from_natural(new_nat)
    if not isinstance(new_user, tuple):
        new_user = (new_user,)
    return _raw(family, new_user)


# -- discrete families --------------------------------------------------------------------------
def num_categories(family, logits):
    return 2 if family == "bernoulli" else logits.shape[-1]


def enumeration_size(family, logits):
    """Number of loss evaluations needed to enumerate the site element by element."""
    k = num_categories(family, logits)
    n = logits.size if family == "bernoulli" else logits.size // k
    return n * k


def grad_mu_enumerated(block, fn, params):
    r""":math:`\nabla_\mu\mathbb E_q[\ell]` of a discrete site by local enumeration (module docstring)."""
    name = block.loc
    logits = params[name]
    family = block.family
    k = num_categories(family, logits)
    n = enumeration_size(family, logits) // k
    idx = jnp.repeat(jnp.arange(n), k)
    val = jnp.tile(jnp.arange(k), n)

    def loss_at(i, v):
        with force(name, i, v):
            return fn(params)[0]

    losses = jax.vmap(loss_at)(idx, val).reshape(n, k)
    if family == "bernoulli":
        logq = jnp.stack([jax.nn.log_sigmoid(-logits), jax.nn.log_sigmoid(logits)], -1).reshape(n, 2)
        ell = losses - logq
        return (ell[:, 1] - ell[:, 0]).reshape(logits.shape)
    logq = jax.nn.log_softmax(logits, -1).reshape(n, k)
    ell = losses - logq
    return (ell[:, :-1] - ell[:, -1:]).reshape(logits.shape[:-1] + (k - 1,))


def grad_mu_score(block, fn, params, key, num_samples=SCORE_SAMPLES):
    r""":math:`\nabla_\mu\mathbb E_q[\ell]` of a discrete site by the score-function estimator with a
    leave-one-out baseline (module docstring), from ``num_samples`` draws of the whole site.

    Written as :math:`\frac{1}{S-1}\sum_s(\ell_s-\bar\ell)\,w(z_s)` with
    :math:`w = F^{-1}(T(z) - \mu)`: per Bernoulli element :math:`z/p - (1-z)/(1-p)`, per Categorical
    element :math:`1[z=k]/p_k - 1[z=K-1]/p_{K-1}` (the score-function form of the enumerated
    :math:`\ell(1) - \ell(0)` and :math:`\ell(k) - \ell(K-1)`). Inverse probabilities are computed
    from the logits (:math:`1/p = 1 + e^{-\lambda}`), so they stay finite in float32."""
    if num_samples < 2:
        raise ValueError(f"the score-function estimator needs at least 2 samples, got {num_samples}.")
    name = block.loc
    logits = params[name]
    axes = tuple(range(1, logits.ndim + 1))
    if block.family == "bernoulli":
        z = jax.random.bernoulli(key, jax.nn.sigmoid(logits), (num_samples,) + logits.shape)
        logq = jnp.sum(jnp.where(z, jax.nn.log_sigmoid(logits), jax.nn.log_sigmoid(-logits)), axis=axes)
        w = jnp.where(z, 1.0 + jnp.exp(-logits), -(1.0 + jnp.exp(logits)))
    else:
        k = logits.shape[-1]
        z = jax.random.categorical(key, logits, shape=(num_samples,) + logits.shape[:-1])
        onehot = jax.nn.one_hot(z, k, dtype=bool)
        logp = jax.nn.log_softmax(logits, -1)
        logq = jnp.sum(jnp.where(onehot, logp, 0.0), axis=axes)
        inv_p = jnp.where(onehot, jnp.exp(-logp), 0.0)  # 1[z=k] / p_k
        w = inv_p[..., :-1] - inv_p[..., -1:]

    def loss_at(value):
        with force(name, None, value):
            return fn(params)[0]

    ell = jax.vmap(loss_at)(z) - logq
    centred = (ell - jnp.mean(ell)).astype(logits.dtype)
    return jnp.tensordot(centred, w.astype(logits.dtype), axes=1) / (num_samples - 1)


def grad_mu_discrete(block, fn, params, key=None, max_enumerate=MAX_ENUMERATE, score_samples=SCORE_SAMPLES):
    r""":math:`\nabla_\mu\mathbb E_q[\ell]` of a discrete site: enumerated when it needs at most
    ``max_enumerate`` loss evaluations (``None``: always), otherwise the score-function estimator
    with ``score_samples`` draws from ``key``."""
    size = enumeration_size(block.family, params[block.loc])
    if max_enumerate is None or size <= max_enumerate:
        return grad_mu_enumerated(block, fn, params)
    if key is None:
        raise ValueError(
            f"the discrete site with parameter {block.loc!r} needs {size} > max_enumerate={max_enumerate} loss "
            "evaluations to enumerate; the score-function estimator used instead needs a random key."
        )
    return grad_mu_score(block, fn, params, key, score_samples)


def update_discrete(block, fn, params, lr, improved, key=None, max_enumerate=None, score_samples=SCORE_SAMPLES):
    fam = FAMILIES[block.family]
    logits = params[block.loc]
    nat = fam.to_natural(logits)
    g = grad_mu_discrete(block, fn, params, key, max_enumerate, score_samples)
    new_nat = fam.blr_update(nat, fam.Expectation(g), lr, improved)
    return (fam.from_natural(new_nat),)


def update_block(block, fn, params, grads, lr, improved, key=None, max_enumerate=None, score_samples=SCORE_SAMPLES):
    """New raw parameters ``{name: value}`` of one EXPFAM block after a BLR step.

    A discrete site is enumerated when that takes at most ``max_enumerate`` loss evaluations
    (``None``: always), otherwise estimated by ``score_samples`` draws from ``key``."""
    if block.family in DISCRETE:
        new = update_discrete(block, fn, params, lr, improved, key, max_enumerate, score_samples)
    else:
        raw = tuple(params[n] for n in block.names)
        grad_raw = tuple(grads[n] for n in block.names)
        new = update_continuous(block.family, raw, grad_raw, lr, improved)
    return {n: v.astype(params[n].dtype) for n, v in zip(block.names, new)}

r"""IVON: the improved variational online Newton method as pure JAX functions.

Shen, Daheim, Cong, Nickl, Marconi, Bazan, Yokota, Gurevych, Cremers, Khan & Möllenhoff (2024),
"Variational Learning is Effective for Large Deep Networks", ICML 2024 (Algorithm 1).

IVON learns a diagonal Gaussian :math:`q(\theta) = \mathcal N(m, \operatorname{diag}(\sigma^2))`,
:math:`\sigma^2 = 1/(\lambda (h + \delta))`, where :math:`\lambda` is the effective sample size
(``ess``, normally the training-set size), :math:`\delta` the weight decay (a Gaussian prior of
precision :math:`\lambda\delta`) and :math:`h` the running Hessian estimate of the per-example loss.
One step with :math:`S` Monte Carlo samples is, in this order:

.. math::
    \theta_s &= m + \epsilon_s / \sqrt{\lambda (h + \delta)}, \quad \epsilon_s \sim \mathcal N(0, I), \\
    \hat g &= \tfrac1S \textstyle\sum_s \nabla \bar\ell(\theta_s), \qquad
    \hat h = \lambda (h + \delta)\, \tfrac1S \textstyle\sum_s (\theta_s - m) \odot \nabla\bar\ell(\theta_s)
        \quad \text{(Price/Stein, pre-update } h), \\
    g_m &\leftarrow \beta_1 g_m + (1-\beta_1) \hat g, \\
    h &\leftarrow \beta_2 h + (1-\beta_2) \hat h
        + \tfrac12 (1-\beta_2)^2 (h - \hat h)^2 / (h + \delta), \\
    m &\leftarrow m - \alpha_t\, c\, \operatorname{clip}\!\Big(
        \frac{g_m/(1-\beta_1^t) + \delta m}{h + \delta}, \pm r\Big), \qquad
        c = h_0 + \delta \text{ if ``rescale_lr`` else } 1.

``hess_approx='gradsq'`` replaces the Price estimate by :math:`\hat h = \lambda\,\tfrac1S\sum_s
\nabla\bar\ell(\theta_s)^2` (a squared-gradient / Gauss-Newton-like estimate, as in the reference
implementation, which does not multiply it by :math:`h+\delta`).

The third term of the :math:`h` update is the improved-BLR correction (Lin, Schmidt & Khan 2020):
with :math:`P = h + \delta` and :math:`x = (1-\beta_2)(\hat h - h)/P` it gives
:math:`P_{\rm new} = P (1 + x + x^2/2) \ge P/2 > 0` for *any* :math:`\hat h`, so the variance stays
positive even though the Price estimate can be negative.

The loss :math:`\bar\ell` is the **average** per-example loss of a mini-batch (what you would
hand to SGD or Adam); ``ess`` turns it into the sum over the data set. The weight decay enters
both the prior and the update, so do not add an L2 term to the loss as well.

Everything is a pure function of arrays; the state is an :class:`IVONState` pytree and
all randomness comes from the ``key`` argument, so ``step`` can be ``jax.jit``-ed, ``lax.scan``-ed
and ``pmap``-ed (set ``axis_name`` to average the gradient statistics over devices).
"""

import math
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from numpyro_blr.core import all_finite as _all_finite
from numpyro_blr.core import check_fraction, check_params
from numpyro_blr.core import check_positive as _check_positive
from numpyro_blr.core import is_number as _is_number
from numpyro_blr.core import select as _select
from numpyro_blr.core import value_at as _lr_at

HESS_APPROX = ("price", "gradsq")


class ParamLayout(NamedTuple):
    """How a pytree of same-dtype arrays maps to one flat vector (hashable: jit-static)."""

    treedef: Any
    shapes: tuple
    dtype: str

    @classmethod
    def of(cls, tree):
        leaves, treedef = jax.tree.flatten(tree)
        return cls(treedef, tuple(tuple(jnp.shape(x)) for x in leaves), str(jnp.result_type(*leaves)))

    def ravel(self, tree):
        leaves = self.treedef.flatten_up_to(tree)
        flat = [jnp.reshape(jnp.asarray(x, self.dtype), (-1,)) for x in leaves]
        return flat[0] if len(flat) == 1 else jnp.concatenate(flat)

    def unravel(self, flat):
        out, start = [], 0
        for shape in self.shapes:
            n = int(np.prod(shape))
            out.append(flat[start:start + n].reshape(shape))
            start += n
        return self.treedef.unflatten(out)


@jax.tree_util.register_pytree_node_class
class IVONState:
    """IVON state (fixed-shape arrays only).

    ``params``     the posterior mean :math:`m` (pytree like the model parameters);
    ``hess``       the Hessian estimate :math:`h` (same pytree), variance is ``1/(ess*(hess+delta))``;
    ``momentum``   the gradient EMA :math:`g_m` (same pytree);
    ``count``      number of steps taken (skipped steps are not counted), int32;
    ``nonfinite``  bool, whether the *last* step was skipped for a non-finite gradient/update;
    ``skipped``    int32, how many steps were skipped so far.

    Constructed like a ``NamedTuple`` from those six fields (and ``_replace`` works the same way),
    but :math:`m`, :math:`h` and :math:`g_m` are *stored* as three flat vectors (``mean_flat``,
    ``hess_flat``, ``momentum_flat``; ``layout`` maps them to the parameters' pytree), so that a
    step is a few fused passes over contiguous memory with no per-step packing: ``params``,
    ``hess`` and ``momentum`` are views computed on access.
    """

    _fields = ("params", "hess", "momentum", "count", "nonfinite", "skipped")

    def __init__(self, params, hess, momentum, count, nonfinite, skipped):
        layout = ParamLayout.of(params)
        self._set(layout, layout.ravel(params), layout.ravel(hess), layout.ravel(momentum), count, nonfinite, skipped)

    def _set(self, layout, mean, hess, momentum, count, nonfinite, skipped):
        self.layout = layout
        self.mean_flat, self.hess_flat, self.momentum_flat = mean, hess, momentum
        self.count, self.nonfinite, self.skipped = count, nonfinite, skipped

    @classmethod
    def from_flat(cls, layout, mean, hess, momentum, count, nonfinite, skipped):
        state = object.__new__(cls)
        state._set(layout, mean, hess, momentum, count, nonfinite, skipped)
        return state

    @property
    def params(self):
        return self.layout.unravel(self.mean_flat)

    @property
    def hess(self):
        return self.layout.unravel(self.hess_flat)

    @property
    def momentum(self):
        return self.layout.unravel(self.momentum_flat)

    def _replace(self, **kwargs):
        unknown = set(kwargs) - set(self._fields)
        if unknown:
            raise ValueError(f"IVONState has no field(s) {sorted(unknown)}; fields: {self._fields}.")
        flat = {"params": self.mean_flat, "hess": self.hess_flat, "momentum": self.momentum_flat}
        for k in ("params", "hess", "momentum"):
            if k in kwargs:
                flat[k] = self.layout.ravel(kwargs.pop(k))
        rest = {k: kwargs.get(k, getattr(self, k)) for k in ("count", "nonfinite", "skipped")}
        return IVONState.from_flat(self.layout, flat["params"], flat["hess"], flat["momentum"], **rest)

    def tree_flatten(self):
        children = (self.mean_flat, self.hess_flat, self.momentum_flat, self.count, self.nonfinite, self.skipped)
        return children, self.layout

    @classmethod
    def tree_unflatten(cls, layout, children):
        return cls.from_flat(layout, *children)

    def __repr__(self):
        return (f"IVONState(params={self.layout.treedef}, {sum(int(np.prod(s)) for s in self.layout.shapes)} "
                f"numbers, count={self.count}, nonfinite={self.nonfinite}, skipped={self.skipped})")


class IVONFunctions(NamedTuple):
    """The functions returned by :func:`ivon` (optax/blackjax style, all pure)."""

    init: Callable
    sample: Callable
    update: Callable
    step: Callable
    predictive: Callable
    apply: Callable


# ----------------------------------------------------------------------------- validation


def _check_lr(lr):
    if callable(lr):
        return lr
    return _check_positive(lr, "lr")


def _check_beta(beta, name):
    return check_fraction(beta, name)


def _check_ess(ess):
    if ess is None:
        raise ValueError(
            "ess (effective sample size) is required: set it to the number of training examples."
        )
    return _check_positive(ess, "ess")


# ----------------------------------------------------------------------------- helpers


def init_diagonal_state(state_cls, params, curvature_init):
    """A fresh diagonal-Gaussian optimizer state ``state_cls(params, curvature, momentum, count,
    nonfinite, skipped)`` (the layout shared by IVON, VOGN and BSAM) after checking ``params``."""
    check_params(params)
    params = jax.tree.map(jnp.asarray, params)
    return state_cls(
        params,
        jax.tree.map(lambda p: jnp.full_like(p, curvature_init), params),
        jax.tree.map(jnp.zeros_like, params),
        jnp.zeros((), jnp.int32),
        jnp.zeros((), bool),
        jnp.zeros((), jnp.int32),
    )


def normal_like(key, tree):
    """Standard-normal pytree shaped like ``tree`` from one draw (one RNG call keeps compiles small)."""
    leaves, treedef = jax.tree.flatten(tree)
    sizes = [int(np.prod(jnp.shape(x))) for x in leaves]
    flat = jax.random.normal(key, (sum(sizes),), jnp.result_type(leaves[0]))
    out, start = [], 0
    for x, n in zip(leaves, sizes):
        out.append(flat[start:start + n].reshape(jnp.shape(x)))
        start += n
    return jax.tree.unflatten(treedef, out)


NOISE_RNG = ("hash", "jax")

_TWO_PI_2_30 = np.float32(np.pi / 2 * 2.0**-30)
_HALF_PI = np.float32(np.pi / 2)
# Taylor coefficients of cos on [0, pi/2] up to t^12: truncation error < 6.2e-9 (float32 eps 6e-8)
_COS_COEF = [np.float32((-1) ** k / math.factorial(2 * k)) for k in range(7)]


def _mix32(x):
    """``lowbias32`` (C. Wellons, *hash-prospector*): a bijective 32-bit integer mixer."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x21F0AAAD)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x735A2D97)
    return x ^ (x >> 15)


def _cos_of_bits(b):
    """``cos(2 pi b / 2^32)`` for uint32 ``b``: the top two bits pick the quadrant, the other 30 the
    angle in it, evaluated by one even polynomial on ``[0, pi/2]`` (no range reduction needed)."""
    q = b >> 30
    t = (b & jnp.uint32(0x3FFFFFFF)).astype(jnp.float32) * _TWO_PI_2_30
    t = jnp.where((q & 1) == 1, _HALF_PI - t, t)  # q=1: -sin t = -cos(pi/2-t); q=3: sin t = cos(pi/2-t)
    t2 = t * t
    c = _COS_COEF[-1]
    for coef in _COS_COEF[-2::-1]:
        c = c * t2 + coef
    return jnp.where((q == 1) | (q == 2), -c, c)


def hash_normal(key, n, dtype=jnp.float32):
    r"""``n`` standard normals from ``key``, cheaply: a counter-based hash and Box-Muller.

    ``jax.random.bits(key, (4,))`` gives four 32-bit key words (one small call of the key's own PRNG,
    threefry by default). Pair ``j`` gets two independent 32-bit words
    :math:`a_j = \mathrm{mix}(\mathrm{mix}(j \oplus k_0) + k_1)`,
    :math:`b_j = \mathrm{mix}(\mathrm{mix}(j \oplus k_2) + k_3)` (``mix`` = the ``lowbias32``
    integer hash); :math:`u = (\lfloor a/2^8\rfloor + 1)/2^{24} \in (0, 1]`, :math:`\phi = 2\pi b/2^{32}`
    and the Box-Muller pair :math:`\sqrt{-2\log u}\,(\cos\phi, \sin\phi)` fills elements ``j`` and
    ``j + ceil(n/2)``. The cosine is a degree-12 polynomial on a quarter turn (error < 1e-8).

    Resolution is float32 (24-bit radius, 30-bit angle; ``|z| <= 5.77``, i.e. the tail beyond
    5.77 s.d., probability 8e-9, is cut); the result is cast to ``dtype``. The hash is not
    cryptographic and not a certified stream generator like threefry: it is meant for Monte Carlo
    weight noise, where it is 4-6x cheaper than ``jax.random.normal`` on CPU. jit/vmap-able, pure.
    """
    n = int(n)
    k = jax.random.bits(key, (4,), jnp.uint32)
    half = (n + 1) // 2
    j = lax.iota(jnp.uint32, half)
    a = _mix32(_mix32(j ^ k[0]) + k[1])
    b = _mix32(_mix32(j ^ k[2]) + k[3])
    u = ((a >> 8) + 1).astype(jnp.float32) * np.float32(2.0**-24)
    r = jnp.sqrt(np.float32(-2.0) * jnp.log(u))
    # materialise the radius and angle once: otherwise XLA's concatenate fusion recomputes the log
    # for each of the two outputs of a pair
    r, b = lax.optimization_barrier((r, b))
    z = jnp.concatenate([r * _cos_of_bits(b), r * _cos_of_bits(b - jnp.uint32(1 << 30))])
    return z[:n].astype(dtype)


def standard_normal(key, n, dtype=jnp.float32, rng="hash"):
    """``n`` standard normals: :func:`hash_normal` (``rng='hash'``) or ``jax.random.normal`` with the
    key's own PRNG implementation (``rng='jax'``: threefry, or ``rbg``/``unsafe_rbg`` if the key was
    made with ``jax.random.key(seed, impl=...)``)."""
    if rng == "hash":
        return hash_normal(key, n, dtype)
    return jax.random.normal(key, (int(n),), dtype)


def _stack_samples(samples, like, what):
    """Accept one pytree, a stacked pytree (leading MC axis) or a list of pytrees; return stacked."""
    struct = jax.tree.structure(like)
    if jax.tree.structure(samples) == struct:
        leaves, ref = jax.tree.leaves(samples), jax.tree.leaves(like)
        if all(jnp.ndim(a) == jnp.ndim(r) + 1 for a, r in zip(leaves, ref)):
            return samples
        if all(jnp.shape(a) == jnp.shape(r) for a, r in zip(leaves, ref)):
            return jax.tree.map(lambda a: jnp.asarray(a)[None], samples)
        raise ValueError(f"{what} leaves must have the parameter shapes, optionally with a leading sample axis.")
    if isinstance(samples, (list, tuple)) and samples and all(
        jax.tree.structure(s) == struct for s in samples
    ):
        return jax.tree.map(lambda *xs: jnp.stack(xs), *samples)
    raise ValueError(
        f"{what} must be a pytree like the parameters (optionally with a leading Monte Carlo axis) "
        "or a list of such pytrees."
    )


def hessian_update(h, h_hat, beta2, delta):
    r"""IVON's improved-BLR Hessian step, elementwise:
    :math:`\beta_2 h + (1-\beta_2)\hat h + \tfrac12(1-\beta_2)^2 (h-\hat h)^2/(h+\delta)`.

    Guarantees :math:`h_{\rm new}+\delta \ge (h+\delta)/2` for any ``h_hat``.
    """
    return beta2 * h + (1.0 - beta2) * h_hat + 0.5 * (1.0 - beta2) ** 2 * (h - h_hat) ** 2 / (h + delta)


def predictive(key, state, apply_fn, x, num_samples, *, sample):
    """Average ``apply_fn(params, x)`` over ``num_samples`` draws ``params ~ q`` from ``sample``.

    ``apply_fn`` should return probabilities (apply the softmax inside it): averaging
    probabilities, not logits, is the Bayesian model average. ``sample(key, state)`` is the
    optimizer's ``sample`` (``ivon(...).sample``, ``vogn(...).sample``). Samples are
    ``vmap``-ed; call it on chunks of ``x`` if memory is short.
    """
    keys = jax.random.split(key, num_samples)

    def one(k):
        p, _ = sample(k, state)
        return apply_fn(p, x)

    return jnp.mean(jax.vmap(one)(keys), axis=0)


# ----------------------------------------------------------------------------- IVON


def ivon(
    lr,
    ess=None,
    hess_init=1.0,
    beta1=0.9,
    beta2=0.99999,
    weight_decay=1e-4,
    mc_samples=1,
    hess_approx="price",
    clip_radius=float("inf"),
    rescale_lr=True,
    axis_name: Optional[str] = None,
    vmap_samples=True,
    noise_rng="hash",
) -> IVONFunctions:
    """Build IVON (Shen et al. 2024). Returns an :class:`IVONFunctions` of pure functions:

    ``init(params) -> IVONState``
        ``m = params``, ``h = hess_init``, zero momentum.
    ``sample(key, state) -> (params_sample, noise)``
        ``noise = eps / sqrt(ess*(h + weight_decay))``, ``params_sample = m + noise``.
    ``update(grads, noises, state) -> IVONState``
        ``grads``/``noises``: one pytree, a pytree with a leading Monte Carlo axis, or a list of
        pytrees (one per sample); gradients of the *mean* mini-batch loss at ``m + noise``.
        Steps whose statistics or result are not finite are skipped (state kept,
        ``nonfinite=True``, ``skipped += 1``).
    ``step(key, state, loss_fn, *args) -> (IVONState, loss)``
        samples ``mc_samples`` weights (sample ``s`` with ``jax.random.split(key, mc_samples)[s]``,
        exactly as ``sample``), evaluates ``jax.value_and_grad(loss_fn)(theta, *args)``
        for each (``vmap`` if ``vmap_samples`` else a ``lax.scan`` accumulating the means) and
        updates; ``loss`` is the mean over samples. jit-able (close over ``loss_fn``).
    ``predictive(key, state, apply_fn, x, num_samples) -> mean of apply_fn over q``.
    ``apply(g_bar, stat, state) -> IVONState``
        the step from the Monte Carlo means ``g_bar = mean_s grad`` and ``stat = mean_s noise*grad``
        (``mean_s grad**2`` for ``'gradsq'``); ``update`` is ``apply`` after averaging. Used by
        :class:`numpyro_blr.deep.svi.IVON`, which gets these means from the ELBO gradients.

    ``lr`` may be an optax schedule (``count -> lr``). ``axis_name``: inside ``pmap``/``shard_map``
    the gradient statistics are ``lax.pmean``-ed over that axis (and ``step`` folds the device
    index into the key so each device draws its own weights).

    ``noise_rng`` chooses how the weight noise ``eps`` is drawn: ``'hash'`` (default)
    :func:`hash_normal`, a counter-based hash + Box-Muller seeded by the key, several times cheaper
    than ``jax.random.normal`` on CPU; ``'jax'``: ``jax.random.normal`` with the key's PRNG (threefry
    unless the key was made with ``jax.random.key(seed, impl='rbg')`` etc.). Both draw one vector
    for all parameters (flattened in ``jax.tree.leaves`` order).

    The state keeps :math:`m`, :math:`h` and the momentum as flat vectors (:class:`IVONState`), so
    the noise, the statistics and the update are a few fused passes over contiguous memory; only the
    sampled weights are unflattened (for ``loss_fn``) and the gradient flattened, once per sample.
    """
    lr = _check_lr(lr)
    ess = _check_ess(ess)
    hess_init = _check_positive(hess_init, "hess_init")
    beta1 = _check_beta(beta1, "beta1")
    beta2 = _check_beta(beta2, "beta2")
    delta = _check_positive(weight_decay, "weight_decay", allow_zero=True)
    clip_radius = _check_positive(clip_radius, "clip_radius", allow_inf=True)
    if isinstance(mc_samples, bool) or not isinstance(mc_samples, (int, np.integer)) or mc_samples < 1:
        raise ValueError(f"mc_samples must be an integer >= 1, got {mc_samples!r}.")
    mc_samples = int(mc_samples)
    if hess_approx not in HESS_APPROX:
        raise ValueError(f"hess_approx must be one of {HESS_APPROX}, got {hess_approx!r}.")
    if noise_rng not in NOISE_RNG:
        raise ValueError(f"noise_rng must be one of {NOISE_RNG}, got {noise_rng!r}.")
    price = hess_approx == "price"
    scale = hess_init + delta if rescale_lr else 1.0

    def init(params):
        return init_diagonal_state(IVONState, params, hess_init)

    def _flat_sample(key, m, h):
        """(theta, noise) as flat vectors from the flat mean and Hessian."""
        eps = standard_normal(key, m.shape[0], m.dtype, noise_rng)
        noise = eps * lax.rsqrt(ess * (h + delta)).astype(m.dtype)
        return m + noise, noise

    def sample(key, state):
        theta, noise = _flat_sample(key, state.mean_flat, state.hess_flat)
        return state.layout.unravel(theta), state.layout.unravel(noise)

    def _apply_flat_stats(g, s, state):
        """The IVON step on flat vectors: ``g``/``s`` the MC means of grad and noise*grad (grad**2)."""
        m, h, mom = state.mean_flat, state.hess_flat, state.momentum_flat
        if axis_name is not None:
            g, s = lax.pmean((g, s), axis_name)
        t = state.count + 1
        alpha = _lr_at(lr, state.count)
        h_hat = ess * (h + delta) * s if price else ess * s
        mom_new = beta1 * mom + (1.0 - beta1) * g
        h_new = hessian_update(h, h_hat, beta2, delta)
        debias = 1.0 - jnp.asarray(beta1, m.dtype) ** t.astype(m.dtype)
        direction = (mom_new / debias + delta * m) / (h_new + delta)
        m_new = (m - alpha * scale * jnp.clip(direction, -clip_radius, clip_radius)).astype(m.dtype)
        # One reduction: x * 0 is 0 for finite x and NaN for +-inf/NaN, so the sum is finite iff every
        # entry of the three vectors is. A non-finite g or s makes mom_new resp. h_new non-finite
        # (1 - beta > 0 and m, h, mom are finite), so this is the check "g, s, m, h, mom all finite".
        ok = jnp.isfinite(jnp.sum(m_new * 0 + h_new * 0 + mom_new * 0))
        return IVONState.from_flat(
            state.layout,
            jnp.where(ok, m_new, m),
            jnp.where(ok, h_new, h),
            jnp.where(ok, mom_new, mom),
            count=jnp.where(ok, t, state.count),
            nonfinite=~ok,
            skipped=state.skipped + jnp.where(ok, 0, 1).astype(jnp.int32),
        )

    def _apply(g_bar, stat, state):
        """The IVON step from the MC means ``g_bar`` and ``stat`` (pytrees like the parameters)."""
        return _apply_flat_stats(state.layout.ravel(g_bar), state.layout.ravel(stat), state)

    def _stats(grads, noises):
        g_bar = jax.tree.map(lambda g: jnp.mean(g, axis=0), grads)
        if price:
            stat = jax.tree.map(lambda g, n: jnp.mean(n * g, axis=0), grads, noises)
        else:
            stat = jax.tree.map(lambda g: jnp.mean(g * g, axis=0), grads)
        return g_bar, stat

    def update(grads, noises, state):
        grads = _stack_samples(grads, state.params, "grads")
        if price:
            noises = _stack_samples(noises, state.params, "noises")
            if jax.tree.leaves(noises)[0].shape[0] != jax.tree.leaves(grads)[0].shape[0]:
                raise ValueError("grads and noises must hold the same number of Monte Carlo samples.")
        return _apply(*_stats(grads, noises), state)

    def step(key, state, loss_fn, *args):
        if axis_name is not None:
            key = jax.random.fold_in(key, lax.axis_index(axis_name))
        keys = jax.random.split(key, mc_samples)
        m, h, layout = state.mean_flat, state.hess_flat, state.layout

        def flat_vg(k):
            theta, noise = _flat_sample(k, m, h)
            loss, g = jax.value_and_grad(loss_fn)(layout.unravel(theta), *args)
            g = layout.ravel(g)
            return loss, g, (noise * g if price else g * g)

        if mc_samples == 1:  # no vmap/scan: a batch-1 vmap turns every matmul into a batched one
            loss, g_bar, stat = flat_vg(keys[0])
        elif vmap_samples:
            losses, gs, ss = jax.vmap(flat_vg)(keys)
            loss, g_bar, stat = jnp.mean(losses), jnp.mean(gs, axis=0), jnp.mean(ss, axis=0)
        else:
            def body(carry, k):
                return jax.tree.map(jnp.add, carry, flat_vg(k)), None

            zero = jnp.zeros((), m.dtype)
            (loss, g_sum, s_sum), _ = lax.scan(body, (zero, jnp.zeros_like(m), jnp.zeros_like(m)), keys)
            loss, g_bar, stat = loss / mc_samples, g_sum / mc_samples, s_sum / mc_samples
        if axis_name is not None:
            loss = lax.pmean(loss, axis_name)
        return _apply_flat_stats(g_bar, stat, state), loss

    def _predictive(key, state, apply_fn, x, num_samples):
        return predictive(key, state, apply_fn, x, num_samples, sample=sample)

    return IVONFunctions(init=init, sample=sample, update=update, step=step, predictive=_predictive, apply=_apply)

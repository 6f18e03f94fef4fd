r"""Pytree helpers shared by every algorithm: flat layouts, weight noise, stacking Monte Carlo samples.

* :class:`FlatLayout` maps a pytree of same-dtype arrays to one flat vector and back. It is a pytree
  node with no children (its shapes are static), so an algorithm's State NamedTuple can carry it
  next to its flat arrays and still be ``jit``-ed, ``scan``-ned and ``vmap``-ped: diagonal rows keep
  their mean, precision and momentum as three contiguous vectors and a step is a few fused passes
  over them, with no per-step packing.
* :func:`hash_normal` / :func:`standard_normal`: weight noise from one key, a counter-based hash and
  Box-Muller (several times cheaper than ``jax.random.normal`` on CPU) or JAX's own generator;
  :func:`uniform_like` shapes one draw like a pytree.
* :func:`stack_samples`: one pytree, a pytree with a leading Monte Carlo axis, or a list of pytrees,
  as one stacked pytree.
"""

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


@jax.tree_util.register_pytree_node_class
class FlatLayout(NamedTuple):
    """How a pytree of same-dtype arrays maps to one flat vector (hashable; a pytree node with no
    children, so it rides along in a State as static structure)."""

    treedef: Any
    shapes: tuple
    dtype: str

    @classmethod
    def of(cls, tree):
        leaves, treedef = jax.tree.flatten(tree)
        return cls(treedef, tuple(tuple(jnp.shape(x)) for x in leaves), str(jnp.result_type(*leaves)))

    @property
    def size(self):
        return sum(int(np.prod(s)) for s in self.shapes)

    def ravel(self, tree):
        leaves = self.treedef.flatten_up_to(tree)
        flat = [jnp.reshape(jnp.asarray(x, self.dtype), (-1,)) for x in leaves]
        return flat[0] if len(flat) == 1 else jnp.concatenate(flat)

    def ravel_batched(self, tree):
        """Like :meth:`ravel` for leaves with one extra leading axis (per-example gradients): ``(M, size)``."""
        leaves = self.treedef.flatten_up_to(tree)
        m = jnp.shape(leaves[0])[0]
        flat = [jnp.reshape(jnp.asarray(x, self.dtype), (m, -1)) for x in leaves]
        return flat[0] if len(flat) == 1 else jnp.concatenate(flat, axis=1)

    def to_params(self, flat):
        """:meth:`unravel` with every leaf cast to the parameters' dtype: the weights a loss is evaluated at when the
        state is kept in a wider dtype than the parameters (mixed precision, :func:`state_dtype`)."""
        return jax.tree.map(lambda x: x.astype(self.dtype), self.unravel(flat))

    def unravel(self, flat):
        """The pytree from a flat vector (trailing axis of ``flat``; leading axes are kept)."""
        lead = flat.shape[:-1]
        out, start = [], 0
        for shape in self.shapes:
            n = int(np.prod(shape))
            out.append(flat[..., start:start + n].reshape(lead + shape))
            start += n
        return self.treedef.unflatten(out)

    # a pytree node without children: the layout is static structure, never traced
    def tree_flatten(self):
        return (), tuple(self)

    @classmethod
    def tree_unflatten(cls, aux, children):
        del children
        return cls(*aux)


LOW_PRECISION = ("bfloat16", "float16")


def state_dtype(param_dtype, requested=None):
    """The dtype of an optimizer's state (mean, precision, momenta) for parameters of ``param_dtype``.

    Mixed precision: bfloat16 or float16 parameters (and their gradients) get a float32 state, because a precision
    or a momentum in 8 or 11 bits of mantissa loses the small steps of training (``1 - beta2 = 1e-5`` is below
    bfloat16's resolution of 1). Other parameters keep their dtype. ``requested`` (the rows' ``state_dtype=``)
    overrides: a floating dtype at least as wide as the parameters and never bfloat16 or float16; anything else is a
    ``ValueError`` naming ``state_dtype``."""
    param_dtype = None if param_dtype is None else jnp.dtype(param_dtype)
    if requested is None:
        return jnp.dtype(jnp.float32) if param_dtype is None or param_dtype.name in LOW_PRECISION else param_dtype
    try:
        want = jnp.dtype(requested)
    except TypeError as err:
        raise ValueError(f"state_dtype must be a floating dtype such as jnp.float32, got {requested!r}.") from err
    if not jnp.issubdtype(want, jnp.floating):
        raise ValueError(f"state_dtype must be a floating dtype such as jnp.float32, got {want.name}.")
    if want.name in LOW_PRECISION:
        raise ValueError(
            f"state_dtype={want.name}" + ("" if param_dtype is None else f" with {param_dtype.name} parameters") + ": the state (mean, precision, momentum) must be "
            "float32 or wider; low-precision parameters and gradients are fine, a low-precision state loses the "
            "optimizer's small updates. Pass state_dtype=jnp.float32 (the default for bfloat16/float16 parameters)."
        )
    if param_dtype is not None and jnp.finfo(want).bits < jnp.finfo(param_dtype).bits:
        raise ValueError(
            f"state_dtype={want.name} is narrower than the {param_dtype.name} parameters: the state holds the mean "
            f"(the master weights); pass state_dtype={param_dtype.name} or wider, or None."
        )
    return want


def stack_samples(samples, like, what):
    """Accept one pytree, a stacked pytree (leading Monte Carlo axis) or a list of pytrees; return stacked."""
    struct = jax.tree.structure(like)
    if jax.tree.structure(samples) == struct:
        leaves, ref = jax.tree.leaves(samples), jax.tree.leaves(like)
        if all(jnp.ndim(a) == jnp.ndim(r) + 1 for a, r in zip(leaves, ref)):
            return samples
        if all(jnp.shape(a) == jnp.shape(r) for a, r in zip(leaves, ref)):
            return jax.tree.map(lambda a: jnp.asarray(a)[None], samples)
        raise ValueError(f"{what} leaves must have the parameter shapes, optionally with a leading sample axis.")
    if isinstance(samples, (list, tuple)) and samples and all(jax.tree.structure(s) == struct for s in samples):
        return jax.tree.map(lambda *xs: jnp.stack(xs), *samples)
    raise ValueError(
        f"{what} must be a pytree like the parameters (optionally with a leading Monte Carlo axis) "
        "or a list of such pytrees."
    )


# ----------------------------------------------------------------------------- noise

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


def uniform_like(key, tree):
    """Uniform(0, 1) pytree shaped like ``tree`` from one draw, strictly inside (0, 1) in its dtype."""
    layout = FlatLayout.of(tree)
    dtype = jnp.dtype(layout.dtype)
    tiny = float(jnp.finfo(dtype).tiny)
    flat = jax.random.uniform(key, (layout.size,), dtype, minval=tiny, maxval=1.0)
    return layout.unravel(jnp.minimum(flat, 1.0 - float(jnp.finfo(dtype).epsneg)))


def hash_uniform(key, n, dtype=jnp.float32):
    r"""``n`` uniforms strictly inside (0, 1) from ``key``, with :func:`hash_normal`'s counter hash: element ``j``
    is :math:`(\lfloor a_j/2^9\rfloor + \tfrac12)/2^{23}`, :math:`a_j = \mathrm{mix}(\mathrm{mix}(j \oplus k_0) + k_1)`
    (23-bit resolution: the extreme values :math:`2^{-24}` and :math:`1 - 2^{-24}` are float32 numbers, so an
    inverse CDF of an unbounded :math:`q_0` stays finite). jit/vmap-able, pure, several times cheaper than
    ``jax.random.uniform`` on CPU."""
    n = int(n)
    k = jax.random.bits(key, (2,), jnp.uint32)
    a = _mix32(_mix32(lax.iota(jnp.uint32, n) ^ k[0]) + k[1])
    return ((a >> 9).astype(jnp.float32) + np.float32(0.5)) * np.float32(2.0**-23)


def uniform(key, n, dtype=jnp.float32, rng="hash"):
    """``n`` uniforms strictly inside (0, 1): :func:`hash_uniform` (``rng='hash'``) or ``jax.random.uniform``."""
    if rng == "hash":
        return hash_uniform(key, n).astype(dtype)
    info = jnp.finfo(dtype)
    return jnp.clip(jax.random.uniform(key, (int(n),), dtype, minval=float(info.tiny), maxval=1.0), float(info.tiny), 1.0 - float(info.epsneg))

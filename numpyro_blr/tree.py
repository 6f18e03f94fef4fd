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
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


#: a padded flat state (:meth:`FlatLayout.of` with ``padded=True``) holds at least this many weights: below it XLA's CPU
#: backend does not split an elementwise loop between threads (a loop over 26,123 float32 is not split, one over
#: 40,001 is), so a padding would cost and save nothing
PAD_FROM = 32768
#: a padded flat state's length is a multiple of this: 2^8 x 3 x 5, divisible by every thread count that divides it
#: (2-6, 8, 10, 12, 15, 16, 20, 24, 30, 32, ... 256), so that XLA's CPU backend cuts its loops into equal parts
PAD_MULTIPLE = 3840


def padded_length(n):
    """The length of a padded flat state of ``n`` weights: ``n`` rounded up to a multiple of :data:`PAD_MULTIPLE`
    from :data:`PAD_FROM` weights on, ``n`` below. It depends on ``n`` alone (not on the machine): a state has the
    same shapes wherever it is built."""
    n = int(n)
    return n if n < PAD_FROM else -(-n // PAD_MULTIPLE) * PAD_MULTIPLE


@jax.tree_util.register_pytree_node_class
class FlatLayout(NamedTuple):
    """How a pytree of same-dtype arrays maps to one flat vector and back (hashable; a pytree node with no
    children, so it rides along in a State as static structure).

    ``pad`` trailing entries follow the weights in a padded layout (``FlatLayout.of(tree, padded=True)``, the
    network rows' states): :attr:`size` is the number of weights, :attr:`length` that of the flat vectors. On a CPU
    with several threads XLA cuts every large elementwise loop into one part per thread, and a loop whose length is
    not a multiple of the number of parts masks every vector load and store (docs/deep-learning.md, "Steps on a
    multi-core CPU"): an odd number of weights made every pass of a step over the flat state 2-3x slower on two
    threads. The padding entries hold zeros in the mean, the gradient and the momenta and a positive value in
    precisions and scales; no loss reads them (:meth:`unravel` and :func:`leaves_from` read the weights only), so no
    data gradient reaches them (a weight decay acts on them as on any weight without one)."""

    treedef: Any
    shapes: tuple
    dtype: str
    pad: int = 0

    @classmethod
    def of(cls, tree, padded=False):
        leaves, treedef = jax.tree.flatten(tree)
        shapes = tuple(tuple(jnp.shape(x)) for x in leaves)
        size = sum(int(np.prod(s)) for s in shapes)
        return cls(treedef, shapes, str(jnp.result_type(*leaves)), padded_length(size) - size if padded else 0)

    @property
    def size(self):
        """The number of weights."""
        return sum(int(np.prod(s)) for s in self.shapes)

    @property
    def length(self):
        """The length of the flat vectors: the weights and the padding."""
        return self.size + self.pad

    def ravel(self, tree, fill=0.0, dtype=None):
        """The flat vector of ``tree`` (a pytree like the parameters) in ``dtype`` (default: the parameters'), its
        padding entries ``fill``."""
        dtype = self.dtype if dtype is None else dtype
        leaves = self.treedef.flatten_up_to(tree)
        parts = [jnp.reshape(jnp.asarray(x).astype(dtype), (-1,)) for x in leaves]
        if self.pad:
            parts.append(jnp.full((self.pad,), fill, dtype))
        return concatenate_flat(parts)

    def ravel_batched(self, tree):
        """Like :meth:`ravel` for leaves with one extra leading axis (per-example gradients): ``(M, length)``, the
        padding zeros."""
        leaves = self.treedef.flatten_up_to(tree)
        m = jnp.shape(leaves[0])[0]
        flat = [jnp.reshape(jnp.asarray(x, self.dtype), (m, -1)) for x in leaves]
        if self.pad:
            flat.append(jnp.zeros((m, self.pad), self.dtype))
        return flat[0] if len(flat) == 1 else jnp.concatenate(flat, axis=1)

    def to_params(self, flat):
        """:meth:`unravel` with every leaf cast to the parameters' dtype: the weights a loss is evaluated at when the
        state is kept in a wider dtype than the parameters (mixed precision, :func:`state_dtype`)."""
        return jax.tree.map(lambda x: x.astype(self.dtype), self.unravel(flat))

    def to_params_leaves(self, leaves):
        """The pytree from its leaves (in the layout's order), each cast to the parameters' dtype and written once
        (an optimisation barrier: XLA does not fuse their construction into every consumer)."""
        leaves = [jnp.asarray(x).astype(self.dtype) for x in leaves]
        return lax.optimization_barrier(self.treedef.unflatten(leaves))

    def unravel(self, flat):
        """The pytree from a flat vector (trailing axis of ``flat``; leading axes are kept; the padding is left)."""
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
    :math:`a_j = \mathrm{mix}(j\,(k_0 \lor 1) + k_1)`, :math:`b_j = \mathrm{mix}(j\,(k_2 \lor 1) + k_3)`
    (``mix`` = the ``lowbias32`` integer hash, arithmetic mod :math:`2^{32}`): the key picks an arithmetic
    progression of odd stride, so two keys hash different counters (XOR-ing the counter with a key word
    instead would hash the same set of counters, permuted, for every key word with the same high bits,
    and needs a second round of ``mix`` to break that, which the accelerator layout recomputes twice per
    step: one round per word took IVON's step from 1.30x to 1.26x AdamW's and the additive Lie rule's from
    1.20x to 1.14x on an H200 at 50M weights); :math:`u = (\lfloor a/2^8\rfloor + 1)/2^{24} \in (0, 1]`, :math:`\phi = 2\pi b/2^{32}`
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
    # the pairs are computed for a length that XLA's CPU backend splits evenly between its threads (the values of
    # pairs 0 .. half - 1 do not depend on it; an uneven split masks every vector load and store of the loop:
    # 5x slower on a 2-core AMD EPYC, 931,845 pairs in 8.0 ms where 931,846 take 1.6-1.9 ms; split_loops)
    r, b = _box_muller_pairs(k, _counters(even_split_length(half)))
    # materialise the radius and angle once: otherwise XLA's concatenate fusion recomputes the log for each of the
    # two outputs of a pair
    r, b = lax.optimization_barrier((r, b))
    if split_loops():  # the two halves as the two rows of one loop, which the threads split by rows
        z = (r[None] * _cos_of_bits(b[None] - jnp.asarray([[0], [1 << 30]], jnp.uint32)))[:, :half].reshape(-1)
    else:
        c, s = r * _cos_of_bits(b), r * _cos_of_bits(b - jnp.uint32(1 << 30))
        if jax.default_backend() == "cpu":  # each half written once, then copied into place: a fused concatenation
            # picks its operand per element (0.4 ms slower for 1.9M normals, 14 ms faster for 1.9M + 1); on an
            # accelerator the concatenation is one fused pass
            c, s = lax.optimization_barrier((c, s))
        z = jnp.concatenate([c, s])
    return z[:n].astype(dtype)


def _counters(length):
    """``lax.iota(jnp.uint32, length)``, the counters a hash draw starts from. Where XLA splits loops between threads
    (:func:`split_loops`) and ``length`` divides evenly, they are built as one row per thread of a 2-D iota (counter
    = row x columns + column) and flattened: the same values, but a loop computed from a 1-D iota compiles, when it
    is split, to code that gains nothing from the other threads, while rows are split as whole rows. On two threads
    (Intel Xeon) the logarithm of 933,120 counters took 1.07 ms from a 1-D iota, 0.41 ms from the rows, and
    0.65-0.88 ms on one thread."""
    length = int(length)
    threads = _cpu_threads()
    if not split_loops() or length % threads:
        return lax.iota(jnp.uint32, length)
    cols = length // threads
    rows = lax.broadcasted_iota(jnp.uint32, (threads, cols), 0) * jnp.uint32(cols)
    return (rows + lax.broadcasted_iota(jnp.uint32, (threads, cols), 1)).reshape(-1)


def _box_muller_pairs(k, j):
    """Radius and angle bits of :func:`hash_normal`'s pairs ``j`` (uint32) for the key words ``k``."""
    a = _mix32(j * (k[0] | jnp.uint32(1)) + k[1])
    b = _mix32(j * (k[2] | jnp.uint32(1)) + k[3])
    u = ((a >> 8) + 1).astype(jnp.float32) * np.float32(2.0**-24)
    return jnp.sqrt(np.float32(-2.0) * jnp.log(u)), b


def hash_normal_at(key_words, start, size, n):
    r"""Elements ``start .. start + size`` of ``hash_normal(key, n)`` (float32), each computed on its own from
    ``key_words = jax.random.bits(key, (4,), jnp.uint32)``: element :math:`i` is the cosine half of pair :math:`i`
    (:math:`i < \lceil n/2\rceil`) or the sine half of pair :math:`i - \lceil n/2\rceil`. The same values as
    :func:`hash_normal`'s (bit for bit where the backend evaluates the same operations alike), with nothing stored:
    XLA fuses the draw into whatever reads it, at the price of one logarithm per element instead of per pair."""
    half = (int(n) + 1) // 2
    i = lax.iota(jnp.uint32, int(size)) + jnp.uint32(start)
    second = i >= jnp.uint32(half)
    r, b = _box_muller_pairs(key_words, jnp.where(second, i - jnp.uint32(half), i))
    return r * _cos_of_bits(jnp.where(second, b - jnp.uint32(1 << 30), b))


def standard_normal(key, n, dtype=jnp.float32, rng="hash"):
    """``n`` standard normals: :func:`hash_normal` (``rng='hash'``) or ``jax.random.normal`` with the
    key's own PRNG implementation (``rng='jax'``: threefry, or ``rbg``/``unsafe_rbg`` if the key was
    made with ``jax.random.key(seed, impl=...)``)."""
    if rng == "hash":
        return hash_normal(key, n, dtype)
    return jax.random.normal(key, (int(n),), dtype)


def fused_passes():
    """Whether the steps over a network's flat state are laid out for an accelerator (GPU, TPU) or for the CPU.

    On an accelerator a step is bound by memory traffic, its arithmetic is nearly free and XLA fuses an
    elementwise update with several outputs into one pass: counter-hash noise is then recomputed where it is read
    (:class:`NoiseSlices`) instead of stored, and whether a step is skipped is decided from the estimate before the
    update, so that the select is part of the update's one pass (:func:`numpyro_blr.core.skip_decision`). On CPU
    the arithmetic (a logarithm per pair of normals) is what costs and XLA writes each output of an update in its
    own loop: the noise is drawn once and stored, and the skip is decided after the update from one vector.
    Measured in ``docs/deep-learning.md``. Read when a step is traced (the backend that compiles it is the default
    one)."""
    return jax.default_backend() != "cpu"


def _cpu_threads():
    """The CPUs this process may run on: the most threads XLA's CPU backend splits a loop between."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def split_loops():
    """Whether XLA's CPU backend splits a large elementwise loop between threads (the CPU backend with more than one
    CPU to run on; read when a step is traced, like :func:`fused_passes`).

    Such a loop is cut into equal parts of its outer dimension, one per thread. Two forms then compile to code that
    masks every vector load and store (a bounds check per element), which the AMD EPYC CPUs of this project's
    machines execute 5-15x slower than plain vector code (measured, docs/deep-learning.md, "Steps on a multi-core
    CPU"): a 1-D loop whose length is not a multiple of the number of parts, and a fused concatenation of 1-D
    arrays (the operand is chosen element by element). :func:`concatenate_flat` and :func:`even_split_length`
    avoid both where the step controls the shapes."""
    return jax.default_backend() == "cpu" and _cpu_threads() > 1


def concatenate_flat(parts):
    """``jnp.concatenate(parts)`` of 1-D arrays. Where XLA splits loops between threads (:func:`split_loops`) the
    parts are concatenated as rows of one ``(1, n)`` array: XLA then copies each part into place instead of fusing
    the concatenation into a loop that picks an operand per element (a network's raveled gradient, 1.9M float32:
    1.2-1.6 ms instead of 6-7 ms on 2 cores). The values are the same."""
    if len(parts) == 1:
        return parts[0]
    if split_loops():
        return jnp.concatenate([jnp.reshape(p, (1, -1)) for p in parts], axis=1).reshape(-1)
    return jnp.concatenate(parts)


def even_split_length(n):
    """``n`` rounded up to a multiple of 8 x the CPU threads where XLA splits loops between them (:func:`split_loops`),
    so that a loop of that length is split into whole vectors; ``n`` elsewhere. For work whose first ``n`` results do
    not depend on the length (counter-based noise)."""
    n = int(n)
    if not split_loops():
        return n
    step = 8 * _cpu_threads()
    return -(-n // step) * step


class NoiseSlices:
    r"""One draw of ``n`` flat noise values, read by slices: ``noise(start, size)`` is elements
    ``start .. start + size`` of ``standard_normal(key, n, dtype, rng)`` (``kind='normal'``) or
    ``uniform(key, n, dtype, rng)`` (``kind='uniform'``), and ``noise.all()`` the whole vector.

    This is how a step builds the weights a loss is evaluated at leaf by leaf, straight from the flat state and the
    noise, and later reads the same noise again in its update. With ``rng='hash'`` on an accelerator
    (:func:`fused_passes`) every slice is recomputed from the counter hash where it is read (nothing of the
    parameters' size is stored, so the draw costs no memory traffic); otherwise the draw is made once, kept (an
    optimisation barrier: XLA does not recompute it in each consumer) and sliced. The values are the same either
    way. ``regenerate`` overrides the choice (None: :func:`fused_passes`).
    """

    def __init__(self, key, n, dtype=jnp.float32, rng="hash", kind="normal", regenerate=None):
        self.n, self.dtype, self.rng, self.kind = int(n), dtype, rng, kind
        regenerate = fused_passes() if regenerate is None else regenerate
        self.words = None
        if rng == "hash" and regenerate:
            self.words = jax.random.bits(key, (4,) if kind == "normal" else (2,), jnp.uint32)
            self.stored = None
        else:
            draw = standard_normal if kind == "normal" else uniform
            self.stored = lax.optimization_barrier(draw(key, self.n, dtype, rng))

    def __call__(self, start, size):
        if self.stored is not None:
            return self.stored if (start, size) == (0, self.n) else self.stored[start:start + size]
        if self.kind == "normal":
            return hash_normal_at(self.words, start, size, self.n).astype(self.dtype)
        return hash_uniform_at(self.words, start, size).astype(self.dtype)

    def all(self):
        return self(0, self.n)


def leaves_from(layout, flat_slice):
    """The parameters' pytree whose leaf ``i`` is ``flat_slice(start_i, size_i)`` (the flat elements of that leaf,
    a vector) reshaped and cast to the parameters' dtype, each leaf written once (an optimisation barrier): the
    weights a loss is evaluated at, built from the flat state without writing a flat copy first. Without the barrier
    XLA fuses the construction into every consumer of a small leaf (a bias is read by the forward and the backward
    pass) and recomputes it there."""
    return layout.to_params_leaves(
        [jnp.reshape(flat_slice(start, size), shape) for (start, size), shape in zip(leaf_slices(layout), layout.shapes)]
    )


def leaf_slices(layout):
    """``(start, size)`` of every leaf in the flat layout."""
    out, start = [], 0
    for shape in layout.shapes:
        size = int(np.prod(shape))
        out.append((start, size))
        start += size
    return out


def finite_check(tree):
    """A scalar that is 0 when every entry of ``tree`` is finite and NaN otherwise (``sum(x - x)``: one read of each
    leaf, no write); a step is skipped where it is not finite. It can be ``lax.pmean``-ed across devices."""
    leaves = [x for x in jax.tree.leaves(tree) if x is not None]
    total = None
    for x in leaves:
        term = jnp.sum(x - x)
        total = term if total is None else total + term.astype(total.dtype)
    return jnp.zeros(()) if total is None else total


def uniform_like(key, tree):
    """Uniform(0, 1) pytree shaped like ``tree`` from one draw, strictly inside (0, 1) in its dtype."""
    layout = FlatLayout.of(tree)
    dtype = jnp.dtype(layout.dtype)
    tiny = float(jnp.finfo(dtype).tiny)
    flat = jax.random.uniform(key, (layout.size,), dtype, minval=tiny, maxval=1.0)
    return layout.unravel(jnp.minimum(flat, 1.0 - float(jnp.finfo(dtype).epsneg)))


def hash_uniform(key, n, dtype=jnp.float32):
    r"""``n`` uniforms strictly inside (0, 1) from ``key``, with :func:`hash_normal`'s counter hash: element ``j``
    is :math:`(\lfloor a_j/2^9\rfloor + \tfrac12)/2^{23}`, :math:`a_j = \mathrm{mix}(j\,(k_0 \lor 1) + k_1)`
    (23-bit resolution: the extreme values :math:`2^{-24}` and :math:`1 - 2^{-24}` are float32 numbers, so an
    inverse CDF of an unbounded :math:`q_0` stays finite). jit/vmap-able, pure, several times cheaper than
    ``jax.random.uniform`` on CPU."""
    n = int(n)
    k = jax.random.bits(key, (2,), jnp.uint32)
    return _hash_uniforms(k, _counters(n))


def hash_uniform_at(key_words, start, size):
    """Elements ``start .. start + size`` of :func:`hash_uniform` from ``key_words = jax.random.bits(key, (2,),
    jnp.uint32)`` (each element depends on its index alone)."""
    return _hash_uniforms(key_words, lax.iota(jnp.uint32, int(size)) + jnp.uint32(start))


def _hash_uniforms(key_words, j):
    """:func:`hash_uniform`'s elements at the uint32 counters ``j``."""
    a = _mix32(j * (key_words[0] | jnp.uint32(1)) + key_words[1])
    return ((a >> 9).astype(jnp.float32) + np.float32(0.5)) * np.float32(2.0**-23)


def uniform(key, n, dtype=jnp.float32, rng="hash"):
    """``n`` uniforms strictly inside (0, 1): :func:`hash_uniform` (``rng='hash'``) or ``jax.random.uniform``."""
    if rng == "hash":
        return hash_uniform(key, n).astype(dtype)
    info = jnp.finfo(dtype)
    return jnp.clip(jax.random.uniform(key, (int(n),), dtype, minval=float(info.tiny), maxval=1.0), float(info.tiny), 1.0 - float(info.epsneg))

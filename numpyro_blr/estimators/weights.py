r"""Estimators for a diagonal Gaussian over a network's weights (the deep-learning rows of Table 1).

Each constructor returns ``estimate(key, state, loss_fn, *batch) -> Estimate`` for a
:class:`~numpyro_blr.rules.diagonal.DiagonalState` :math:`q = \mathcal N(m, \operatorname{diag}(1/(Np)))`,
with flat ``grad`` :math:`\hat g \approx \mathbb E_q[\nabla\bar\ell]` and ``hessian``
:math:`\hat h \approx \mathbb E_q[\nabla^2\bar\ell]` of the average mini-batch loss :math:`\bar\ell`
(``loss_fn(params, *batch)``; per-example rows take ``per_example_loss(params, *example)`` and a
batch with a leading example axis):

==========================  ==================================================================
:func:`price`               Bonnet / Price with weight noise (IVON): :math:`\theta = m + \sigma\epsilon`,
                            :math:`\hat g = \nabla\bar\ell(\theta)`, :math:`\hat h = \epsilon\nabla\bar\ell(\theta)/\sigma`
                            (``hess_approx="gradsq"``: :math:`N\,\hat g^2`), averaged over samples
:func:`gauss_newton`        per-example Gauss-Newton (VOGN; OGN at the mean): :math:`\hat h = \frac1M\sum_i g_i^2`
:func:`squared_gradient`    delta method with the squared gradient (Adam, RMSprop): :math:`\hat h = \nabla\bar\ell(m)^2`
:func:`gradient`            delta method, no curvature (SGD)
:func:`sharpness_aware`     bSAM: :math:`\hat g` at the adversarial point :math:`m + \rho g/p`,
                            :math:`\hat h = \sqrt p\,|g| + \gamma` with :math:`g` at a sample
==========================  ==================================================================

The noise is one flat draw per sample (:func:`numpyro_blr.tree.standard_normal`), so it is fresh for
every key and every leaf. :func:`price_from_samples`, :func:`gauss_newton_from_grads`,
:func:`gradient_from_grads` and :func:`sharpness_aware_from_grads` give the same statistics from
gradients a caller computed itself (custom loops, other devices); each estimator's ``from_grads``
attribute does the same for one flat gradient and noise, which is what the optax view of a row
(:func:`numpyro_blr.rules.diagonal.as_optax`) uses.
"""

import jax
import jax.numpy as jnp
from jax import lax

from numpyro_blr.estimators import Estimate
from numpyro_blr.tree import NoiseSlices, finite_check, leaves_from, stack_samples, standard_normal

HESS_APPROX = ("price", "gradsq")


def noise_scale(state, ess):
    r""":math:`\sigma = 1/\sqrt{N p}`, flat."""
    return lax.rsqrt(ess * state.precision).astype(state.mean.dtype)


def draw(key, state, ess, noise_rng="hash"):
    """``(theta, noise)`` flat: one draw of the weights from :math:`q` and its offset from the mean."""
    m = state.mean
    noise = standard_normal(key, m.shape[0], m.dtype, noise_rng) * noise_scale(state, ess)
    return m + noise, noise


def sampled_weights(key, state, ess, noise_rng="hash"):
    r"""``(weights, noise)``: one draw :math:`\theta = m + \sigma\epsilon` of the weights as the parameters' pytree
    (each leaf built from its slice of the flat mean, precision and noise and written once:
    :func:`~numpyro_blr.tree.leaves_from`) and ``noise()``, the flat offset :math:`\sigma\epsilon` as an expression
    for the update to read (the same values as :func:`draw`'s; on accelerators the normals are recomputed there from
    the counter hash rather than stored, :class:`~numpyro_blr.tree.NoiseSlices`)."""
    m, p = state.mean, state.precision
    eps = NoiseSlices(key, m.shape[0], m.dtype, noise_rng)

    def offset(start, size):
        return eps(start, size) * lax.rsqrt(ess * p[start:start + size]).astype(m.dtype)

    weights = leaves_from(state.layout, lambda start, size: m[start:start + size] + offset(start, size))
    return weights, lambda: offset(0, m.shape[0])


def _monte_carlo(fn, keys, vmap_samples):
    """Mean over ``keys`` of the tuple ``fn(key)``: no batching for one key, ``vmap`` or a ``scan``."""
    if keys.shape[0] == 1:  # no vmap: a batch-1 vmap turns every matmul into a batched one
        return fn(keys[0])
    if vmap_samples:
        return jax.tree.map(lambda x: jnp.mean(x, axis=0), jax.vmap(fn)(keys))

    def body(carry, k):
        return jax.tree.map(jnp.add, carry, fn(k)), None

    zero = jax.tree.map(jnp.zeros_like, jax.eval_shape(fn, keys[0]))
    total, _ = lax.scan(body, zero, keys)
    return jax.tree.map(lambda x: x / keys.shape[0], total)


def price(ess, mc_samples=1, hess_approx="price", vmap_samples=True, noise_rng="hash"):
    r"""IVON's estimator: ``mc_samples`` weight draws :math:`\theta_s = m + \sigma\epsilon_s` (key ``s`` of
    ``jax.random.split(key, mc_samples)``), :math:`\hat g = \frac1S\sum_s\nabla\bar\ell(\theta_s)` and
    :math:`\hat h = N p\,\frac1S\sum_s (\theta_s - m)\nabla\bar\ell(\theta_s)` (Price/Stein, unbiased for
    :math:`\mathbb E_q[\nabla^2\bar\ell]`), or :math:`N\frac1S\sum_s\nabla\bar\ell(\theta_s)^2` with ``"gradsq"``."""
    if hess_approx not in HESS_APPROX:
        raise ValueError(f"hess_approx must be one of {HESS_APPROX}, got {hess_approx!r}.")
    gradsq = hess_approx == "gradsq"

    def estimate(key, state, loss_fn, *args):
        layout = state.layout

        def one(k):
            weights, noise = sampled_weights(k, state, ess, noise_rng)
            loss, g = jax.value_and_grad(loss_fn)(weights, *args)
            check = finite_check(g)  # the step is skipped when the gradient is not finite (one read of it)
            g = layout.ravel(g)
            return loss, g, (g * g if gradsq else noise() * g), check

        loss, g, stat, check = _monte_carlo(one, jax.random.split(key, mc_samples), vmap_samples)
        return Estimate(loss, g, ess * (stat if gradsq else state.precision * stat), check)

    def from_grads(state, g, noise):
        return Estimate(jnp.nan, g, ess * (g * g if gradsq else state.precision * noise * g))

    estimate.from_grads, estimate.sampled = from_grads, True
    return estimate


def price_from_samples(state, grads, noises, ess, hess_approx="price"):
    r""":func:`price`'s statistics from gradients ``grads`` at ``mean + noises`` computed by the caller: one
    pytree each, pytrees with a leading Monte Carlo axis, or lists of pytrees."""
    like = state.params
    grads = state.layout.ravel_batched(stack_samples(grads, like, "grads"))
    g = jnp.mean(grads, axis=0)
    if hess_approx == "gradsq":
        return Estimate(jnp.nan, g, ess * jnp.mean(grads * grads, axis=0))
    noises = state.layout.ravel_batched(stack_samples(noises, like, "noises"))
    if noises.shape[0] != grads.shape[0]:
        raise ValueError("grads and noises must hold the same number of Monte Carlo samples.")
    return Estimate(jnp.nan, g, ess * state.precision * jnp.mean(noises * grads, axis=0))


def gauss_newton_from_grads(state, per_example_grads):
    r"""Per-example gradients (leaves ``(M, *shape)``, ``(S, M, *shape)`` or a list over samples of the
    former) -> :math:`\hat g = \operatorname{mean} g_i`, :math:`\hat h = \operatorname{mean} g_i^2`."""
    like = state.params
    struct = jax.tree.structure(like)
    if isinstance(per_example_grads, (list, tuple)) and jax.tree.structure(per_example_grads) != struct:
        if not per_example_grads or not all(jax.tree.structure(g) == struct for g in per_example_grads):
            raise ValueError("per-example grads must be a pytree like the parameters or a list of such pytrees.")
        per_example_grads = jax.tree.map(lambda *xs: jnp.stack(xs), *per_example_grads)
    if jax.tree.structure(per_example_grads) != struct:
        raise ValueError("per-example grads must be a pytree like the parameters or a list of such pytrees.")
    extra = {jnp.ndim(g) - jnp.ndim(p) for g, p in zip(jax.tree.leaves(per_example_grads), jax.tree.leaves(like))}
    if extra == {1}:
        per_example_grads = jax.tree.map(lambda g: g[None], per_example_grads)
    elif extra != {2}:
        raise ValueError(
            "per-example grads need a leading example axis (M, *shape) or sample and example axes (S, M, *shape)."
        )
    leaves = jax.tree.leaves(per_example_grads)
    s, m = leaves[0].shape[:2]
    flat = state.layout.ravel_batched(jax.tree.map(lambda g: g.reshape((s * m,) + g.shape[2:]), per_example_grads))
    return Estimate(jnp.nan, jnp.mean(flat, axis=0), jnp.mean(flat * flat, axis=0))


def check_batch(batch, what="batch"):
    """The number of examples of a per-example ``batch``: every array needs the same leading (example) axis, which
    ``per_example_loss(params, *example)`` is mapped over; a ``ValueError`` names the arrays that disagree."""
    sizes = []
    for i, a in enumerate(batch):
        shape = jnp.shape(a)
        if not shape:
            raise ValueError(
                f"{what} array {i} is a scalar: a per-example loss is mapped over the leading (example) axis of every "
                "batch array; pass arrays of shape (M, ...), or close over constants in the loss."
            )
        sizes.append(shape[0])
    if len(set(sizes)) > 1:
        shapes = ", ".join(f"{i}: {tuple(jnp.shape(a))}" for i, a in enumerate(batch))
        raise ValueError(
            f"{what} arrays disagree on the leading (example) axis that the per-example loss is mapped over "
            f"(shapes {shapes}): give every array the same number of examples M."
        )
    return sizes[0] if sizes else None


def per_example_grads(per_example_loss, params, *batch):
    """``jax.vmap(jax.grad(per_example_loss))`` over the leading axis of every ``batch`` array."""
    check_batch(batch)
    in_axes = (None,) + (0,) * len(batch)
    return jax.vmap(jax.grad(per_example_loss), in_axes=in_axes)(params, *batch)


def gauss_newton(ess=None, mc_samples=1, noise_rng="jax"):
    r"""VOGN's estimator: ``mc_samples`` weight draws (none, at the mean, when ``ess`` is None: OGN),
    per-example gradients :math:`g_i` of ``per_example_loss(params, *example)`` at each, and
    :math:`\hat g = \operatorname{mean}_{s,i} g_i`, :math:`\hat h = \operatorname{mean}_{s,i} g_i^2`."""

    def estimate(key, state, per_example_loss, *batch):
        check_batch(batch)
        layout = state.layout
        in_axes = (None,) + (0,) * len(batch)
        value_and_grads = jax.vmap(jax.value_and_grad(per_example_loss), in_axes=in_axes)
        if ess is None:
            thetas = state.mean[None]
        else:
            keys = jax.random.split(key, mc_samples)
            thetas = jax.vmap(lambda k: draw(k, state, ess, noise_rng)[0])(keys)
        losses, grads = jax.vmap(lambda th: value_and_grads(layout.to_params(th), *batch))(thetas)
        flat = jax.vmap(layout.ravel_batched)(grads).astype(state.mean.dtype)  # (S, M, size), in the state's dtype
        flat = flat.reshape((-1, flat.shape[-1]))
        return Estimate(jnp.mean(losses), jnp.mean(flat, axis=0), jnp.mean(flat * flat, axis=0))

    def from_grads(state, g, noise, squared_grads=None):
        del noise
        if squared_grads is None:
            raise ValueError(
                "the Gauss-Newton rows (VOGN, OGN) need the mean of the per-example squared gradients: "
                "pass squared_grads=jax.tree.map(lambda g: jnp.mean(g**2, 0), nb.deep.per_example_grads(...)) "
                "to the transformation's update."
            )
        return Estimate(jnp.nan, g, state.layout.ravel(squared_grads))

    estimate.from_grads, estimate.sampled = from_grads, ess is not None
    return estimate


def gradient(squared=False):
    r"""The delta method: :math:`\hat g = \nabla\bar\ell(m)`; with ``squared``, :math:`\hat h = \hat g^2`
    (Adam, RMSprop: the squared gradient as a diagonal Gauss-Newton curvature). The key is not used."""

    def estimate(key, state, loss_fn, *args):
        del key
        loss, g = jax.value_and_grad(loss_fn)(state.params, *args)
        g = state.layout.ravel(g)
        return Estimate(loss, g, g * g if squared else None)

    def from_grads(state, g, noise):
        del noise
        return Estimate(jnp.nan, g, g * g if squared else None)

    estimate.from_grads, estimate.sampled = from_grads, False
    return estimate


def gradient_from_grads(state, grads, squared=False):
    """:func:`gradient`'s statistics from the gradient at the mean computed by the caller."""
    g = state.layout.ravel(grads)
    return Estimate(jnp.nan, g, g * g if squared else None)


def sharpness_aware(ess, rho, damping, msharpness=1, noise_rng="jax"):
    r"""bSAM's estimator (Moellenhoff & Khan 2023, Algorithm 1): per group, a draw
    :math:`\theta = m + \sigma\epsilon`, :math:`g = \nabla\bar\ell(\theta)`, the adversarial point
    :math:`m + \rho g/p` and :math:`\hat g = \nabla\bar\ell(m + \rho g/p)`; the curvature
    :math:`\hat h = \sqrt{p}\,|g| + \gamma` (``damping`` :math:`\gamma`). With ``msharpness > 1`` every batch
    array is split along its leading axis into that many groups (each its own draw); the statistics
    are averaged over groups. The loss is the mean loss at the adversarial points."""

    def group(key, state, loss_fn, args):
        layout = state.layout
        theta, _ = draw(key, state, ess, noise_rng)
        g = layout.ravel(jax.grad(loss_fn)(layout.to_params(theta), *args))
        loss, g_rho = jax.value_and_grad(loss_fn)(layout.to_params(sharpness_point(state, g, rho)), *args)
        return loss, layout.ravel(g_rho), jnp.sqrt(state.precision) * jnp.abs(g)

    def estimate(key, state, loss_fn, *args):
        keys = jax.random.split(key, msharpness)
        if msharpness == 1:
            loss, g_rho, curv = group(keys[0], state, loss_fn, args)
        else:

            def split(a):
                a = jnp.asarray(a)
                if a.ndim == 0 or a.shape[0] % msharpness:
                    raise ValueError(
                        f"msharpness={msharpness}: every batch array needs a leading axis divisible by it, got shape {a.shape}."
                    )
                return a.reshape(msharpness, a.shape[0] // msharpness, *a.shape[1:])

            losses, g_rho, curv = jax.vmap(lambda k, a: group(k, state, loss_fn, a))(keys, jax.tree.map(split, args))
            loss, g_rho, curv = jnp.mean(losses), jnp.mean(g_rho, axis=0), jnp.mean(curv, axis=0)
        return Estimate(loss, g_rho, curv + damping)

    return estimate


def sharpness_point(state, grad, rho):
    r"""bSAM's adversarial point :math:`m + \rho\, g / p` (flat)."""
    return state.mean + rho * grad / state.precision


def sharpness_aware_from_grads(state, grads, perturbed_grads, damping):
    """:func:`sharpness_aware`'s statistics from gradients at the samples and at the adversarial points
    computed by the caller (one pytree each, or with a leading group axis / a list: averaged)."""
    like = state.params
    g = state.layout.ravel_batched(stack_samples(grads, like, "grads"))
    g_rho = state.layout.ravel_batched(stack_samples(perturbed_grads, like, "perturbed_grads"))
    return Estimate(jnp.nan, jnp.mean(g_rho, axis=0), jnp.mean(jnp.sqrt(state.precision) * jnp.abs(g), axis=0) + damping)

r"""The Bayesian learning rule for mixtures of Gaussians, and multimodal optimisation.

Lin, Khan & Schmidt (2019), "Fast and simple natural-gradient variational inference with mixture
of exponential-family approximations", ICML; improved (positive-definite) version from Lin,
Schmidt & Khan (2020), "Handling the positive-definite constraint in the Bayesian learning rule",
ICML (reference code: ``yorkerlin/iBayesLRule``, ``MoG/src/mix_gauss_iBayesLRule.m``).
Khan & Rue (2023), "The Bayesian learning rule", JMLR, Table 1 rows "mixture of Gaussians"
and "multimodal optimisation".

The posterior approximation is a mixture of :math:`K` Gaussians over a flat vector
:math:`\theta \in \mathbb R^d`,

.. math::
    q(\theta) = \sum_{c=1}^K \pi_c\, \mathcal N(\theta \mid m_c, S_c^{-1}),
    \qquad v_c = \log(\pi_c / \pi_K) \ (v_K = 0),

and the target is :math:`\bar p(\theta) \propto e^{-\ell(\theta)}` with ``loss_fn`` :math:`=\ell`
(minus an unnormalised log density). The BLR minimises
:math:`\mathbb E_q[\ell] - \mathcal H(q) = \mathbb E_q[f]` with :math:`f = \ell + \log q`.
Treating :math:`(\theta, c)` as a joint (minimal, conditional) exponential family, the natural
gradient splits per component (Lin et al. 2019, Thm. 3): with
:math:`\mathbb E_c[\cdot] = \mathbb E_{\mathcal N(m_c, S_c^{-1})}[\cdot]`,

.. math::
    S_c &\leftarrow S_c + \rho\, G_c + \tfrac{\rho^2}{2} G_c S_c^{-1} G_c,
        \qquad G_c = \mathbb E_c[\nabla^2 f] = \mathbb E_c[\nabla^2\ell + \nabla^2 \log q], \\
    m_c &\leftarrow m_c - \rho\, S_c^{-1} \mathbb E_c[\nabla f],
        \qquad \text{(new } S_c\text{)} \\
    v_c &\leftarrow v_c - \rho_\pi \big(\mathbb E_c[f] - \mathbb E_K[f]\big).

The second-order term in the first line is the improved BLR: the new precision is
:math:`\tfrac12 S_c + \tfrac12 (S_c + \rho G_c) S_c^{-1}(S_c + \rho G_c) \succ 0` for *any*
symmetric :math:`G_c` (``numpyro_blr.rules.blr``). For :math:`K = 1`, :math:`\nabla^2\log q = -S`
and it is the Gaussian BLR :math:`S \leftarrow (1-\rho) S + \rho\,\mathbb E[\nabla^2\ell]` (+ the
correction).

**Estimating** :math:`\mathbb E_c`. Samples are drawn from :math:`q` itself, stratified over
components (``num_samples`` per component, :math:`\theta_{c's} = m_{c'} + R_{c'}^{-\top}\epsilon`,
:math:`S_{c'} = R_{c'}R_{c'}^\top`, each carrying mass :math:`\pi_{c'}/S`), and a
component-:math:`c` expectation is re-weighted by the responsibility ratio

.. math::
    \mathbb E_c[h] = \mathbb E_q\Big[\frac{q(c\mid\theta)}{\pi_c} h(\theta)\Big]
      \approx \frac{\sum_n \alpha_{nc} h(\theta_n)}{\sum_n \alpha_{nc}},\qquad
      \alpha_{nc} = \frac{\pi_{c'(n)}}{S}\,\frac{\mathcal N(\theta_n\mid m_c, S_c^{-1})}{q(\theta_n)}
      = \frac{\pi_{c'(n)}}{S}\frac{q(c\mid\theta_n)}{\pi_c},

self-normalised so that a constant added to :math:`\ell` leaves every update unchanged.
:math:`\nabla\log q = \bar a = \sum_c r_c a_c` and
:math:`\nabla^2 \log q = \sum_c r_c (a_c a_c^\top - S_c) - \bar a\bar a^\top`
(:math:`r_c = q(c\mid\theta)`, :math:`a_c = -S_c(\theta - m_c)`) are exact. The Hessian of
:math:`\ell` is either exact (``hessian='autodiff'``, ``jax.hessian``) or Price's / Stein's
reparameterisation estimate :math:`\mathbb E_c[\nabla^2\ell] = \mathbb E_c[S_c(\theta-m_c)\nabla\ell^\top]`
(``hessian='price'``, first-order only, symmetrised).

**Multimodal optimisation** (:func:`multimodal_optimization`) is the delta method of Khan & Rue
(2023, Table 1): every :math:`\mathbb E_c[h]` is replaced by :math:`h(m_c)`, i.e. each component
takes an (improved, hence always positive-definite) Newton step on :math:`f = \ell + \log q` at its
own mean. Where components are well separated :math:`\nabla\log q(m_c) \approx 0` and
:math:`\nabla^2\log q(m_c) \approx -S_c`, so the components run Newton's method in parallel with
:math:`S_c \to \nabla^2\ell(m_c)`; where they overlap, :math:`\log q` repels them. At a fixed
point :math:`\pi_c \propto e^{-\ell(m_c)}\,|S_c|^{-1/2}`, the Laplace evidence of each minimum.

Everything is a pure function of arrays; states are ``NamedTuple`` s, all randomness comes from
the ``key`` argument, and ``step`` can be ``jax.jit``-ed and ``lax.scan``-ed. Parameters are a
flat vector; use ``jax.flatten_util.ravel_pytree`` for pytrees.
"""

import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.linalg import cho_solve, solve_triangular
from jax.scipy.special import logsumexp

from numpyro_blr.rules.blr import improved_precision_factor, diagonal_precision_update, full_precision_update

COVARIANCES = ("full", "diagonal")
HESSIANS = ("autodiff", "price")
_LOG_2PI = math.log(2 * math.pi)


class MixtureState(NamedTuple):
    """State of :func:`mixture_blr` / :func:`multimodal_optimization` (fixed-shape arrays only).

    ``means``       (K, d) component means :math:`m_c`;
    ``precisions``  (K, d, d) precisions :math:`S_c` (``'full'``) or (K, d) diagonals (``'diagonal'``);
    ``logits``      (K,) :math:`v_c = \\log(\\pi_c/\\pi_K)`, the last entry is always 0;
    ``count``       int32, steps taken (skipped steps are not counted);
    ``nonfinite``   bool, whether the last step was skipped because something was not finite;
    ``skipped``     int32, how many steps were skipped so far.
    """

    means: jax.Array
    precisions: jax.Array
    logits: jax.Array
    count: jax.Array
    nonfinite: jax.Array
    skipped: jax.Array


class MixtureStats(NamedTuple):
    r"""Per-component expectations driving one step: ``grad`` (K, d) :math:`\mathbb E_c[\nabla f]`,
    ``hess`` (K, d, d) or (K, d) :math:`\mathbb E_c[\nabla^2 f]`, ``value`` (K,) :math:`\mathbb E_c[f]`,
    with :math:`f = \ell + \log q`."""

    grad: jax.Array
    hess: jax.Array
    value: jax.Array


class MixtureFunctions(NamedTuple):
    """The pure functions returned by :func:`mixture_blr` and :func:`multimodal_optimization`."""

    init: Callable
    sample: Callable
    log_prob: Callable
    weights: Callable
    estimate: Callable
    update: Callable
    step: Callable


# ----------------------------------------------------------------------------- validation


def _is_number(x):
    return not isinstance(x, bool) and isinstance(x, (int, float, np.integer, np.floating))


def _check_rate(x, name):
    if callable(x):
        return x
    if not _is_number(x) or not math.isfinite(float(x)) or float(x) <= 0:
        raise ValueError(f"{name} must be a positive finite number or a schedule, got {x!r}.")
    return float(x)


def _check_int(x, name):
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {x!r}.")
    return int(x)


def _rate_at(rate, count):
    return rate(count) if callable(rate) else rate


# ----------------------------------------------------------------------------- mixture algebra


def _chol(precisions, diagonal):
    """Lower Cholesky factors R_c of S_c (sqrt of the diagonal when diagonal)."""
    return jnp.sqrt(precisions) if diagonal else jnp.linalg.cholesky(precisions)


def _component_log_probs(x, means, chols, diagonal):
    """log N(x | m_c, S_c^{-1}) for x (n, d): returns (n, K)."""
    d = means.shape[-1]
    diff = x[:, None, :] - means[None]  # (n, K, d)
    if diagonal:
        maha = jnp.sum((chols[None] * diff) ** 2, -1)
        logdet = jnp.sum(jnp.log(chols), -1)
    else:
        proj = jnp.einsum("kji,nkj->nki", chols, diff)  # R_c^T (x - m_c)
        maha = jnp.sum(proj**2, -1)
        logdet = jnp.sum(jnp.log(jnp.diagonal(chols, axis1=-2, axis2=-1)), -1)
    return -0.5 * d * _LOG_2PI + logdet[None] - 0.5 * maha


def log_weights(logits):
    r""":math:`\log\pi_c = v_c - \operatorname{logsumexp}(v)`."""
    return logits - logsumexp(logits)


def _log_q_terms(x, means, precisions, chols, logits, diagonal):
    r"""For x (n, d): log q(x) (n,), log N_c(x) (n, K), grad log q (n, d), Hessian of log q.

    :math:`\nabla\log q = \bar a`, :math:`\nabla^2\log q = \sum_c r_c(a_c a_c^\top - S_c) - \bar a\bar a^\top`
    with :math:`a_c = -S_c(x - m_c)`, :math:`r_c = q(c\mid x)` (diagonal: the diagonal of it).
    """
    log_n = _component_log_probs(x, means, chols, diagonal)
    joint = log_n + log_weights(logits)[None]
    log_q = logsumexp(joint, axis=-1)
    r = jnp.exp(joint - log_q[:, None])  # (n, K)
    diff = x[:, None, :] - means[None]
    if diagonal:
        a = -precisions[None] * diff  # (n, K, d)
        a_bar = jnp.einsum("nk,nkd->nd", r, a)
        hess = jnp.einsum("nk,nkd->nd", r, a * a - precisions[None]) - a_bar**2
    else:
        a = -jnp.einsum("kij,nkj->nki", precisions, diff)
        a_bar = jnp.einsum("nk,nkd->nd", r, a)
        hess = (
            jnp.einsum("nk,nki,nkj->nij", r, a, a)
            - jnp.einsum("nk,kij->nij", r, precisions)
            - a_bar[:, :, None] * a_bar[:, None, :]
        )
    return log_q, log_n, a_bar, hess


def _sym(a):
    return 0.5 * (a + jnp.swapaxes(a, -1, -2))


def _init_state(means, precisions, logits, num_components, diagonal, precision_init):
    means = jnp.asarray(means)
    if not jnp.issubdtype(means.dtype, jnp.floating):
        means = means.astype(jnp.float32)
    if means.ndim != 2 or means.shape[0] != num_components:
        raise ValueError(
            f"means must have shape (num_components, d) = ({num_components}, d), got {means.shape}."
        )
    d = means.shape[1]
    dtype = means.dtype
    if precisions is None:
        if diagonal:
            precisions = jnp.full((num_components, d), precision_init, dtype)
        else:
            precisions = jnp.broadcast_to(precision_init * jnp.eye(d, dtype=dtype), (num_components, d, d))
    precisions = jnp.asarray(precisions, dtype)
    want = (num_components, d) if diagonal else (num_components, d, d)
    if precisions.shape != want:
        raise ValueError(f"precisions must have shape {want}, got {precisions.shape}.")
    if logits is None:
        logits = jnp.zeros((num_components,), dtype)
    logits = jnp.asarray(logits, dtype)
    if logits.shape != (num_components,):
        raise ValueError(f"logits must have shape ({num_components},), got {logits.shape}.")
    logits = logits - logits[-1]
    return MixtureState(
        means=means,
        precisions=precisions,
        logits=logits,
        count=jnp.zeros((), jnp.int32),
        nonfinite=jnp.zeros((), bool),
        skipped=jnp.zeros((), jnp.int32),
    )


def _make_update(lr, weight_lr, diagonal, improved):
    def update(stats, state):
        """One improved-BLR step of every component and of the mixture weights from ``stats``."""
        alpha = _rate_at(lr, state.count)
        beta = _rate_at(weight_lr, state.count)
        if diagonal:
            new_prec = diagonal_precision_update(state.precisions, state.precisions + stats.hess, alpha, improved)
            new_means = state.means - alpha * stats.grad / new_prec
        else:
            hess = _sym(state.precisions + stats.hess)
            if improved:
                # S_new = F F^T with F = [R, B R^{-T}]/sqrt(2) of full row rank (rules.blr); its
                # Cholesky factor comes from a QR of F^T, never from factorising S_new itself.
                f = jax.vmap(lambda p, h: improved_precision_factor(jnp.linalg.cholesky(p), h, alpha))(state.precisions, hess)
                u = jnp.linalg.qr(jnp.swapaxes(f, -1, -2), mode="r")
                u = u * jnp.sign(jnp.diagonal(u, axis1=-2, axis2=-1))[..., :, None]
                chol = jnp.swapaxes(u, -1, -2)
                new_prec = _sym(f @ jnp.swapaxes(f, -1, -2))
            else:
                new_prec = jax.vmap(lambda p, h: full_precision_update(p, None, h, alpha, False))(
                    state.precisions, hess
                )
                chol = jnp.linalg.cholesky(new_prec)
            new_means = state.means - alpha * jax.vmap(lambda c, g: cho_solve((c, True), g))(chol, stats.grad)
        new_logits = state.logits - beta * (stats.value - stats.value[-1])
        ok = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in (new_prec, new_means, new_logits)]))
        if not diagonal:
            ok = ok & jnp.all(jnp.isfinite(chol))
        pick = lambda a, b: jnp.where(ok, a, b)  # noqa: E731
        return MixtureState(
            means=pick(new_means, state.means),
            precisions=pick(new_prec, state.precisions),
            logits=pick(new_logits, state.logits),
            count=jnp.where(ok, state.count + 1, state.count),
            nonfinite=~ok,
            skipped=state.skipped + jnp.where(ok, 0, 1).astype(jnp.int32),
        )

    return update


def _make_common(diagonal):
    def sample(key, state, num_samples):
        """``num_samples`` ancestral draws from the mixture: (num_samples, d)."""
        k1, k2 = jax.random.split(key)
        comp = jax.random.categorical(k1, state.logits, shape=(num_samples,))
        eps = jax.random.normal(k2, (num_samples, state.means.shape[1]), state.means.dtype)
        chols = _chol(state.precisions, diagonal)
        if diagonal:
            return state.means[comp] + eps / chols[comp]
        noise = jax.vmap(lambda r, e: solve_triangular(r.T, e, lower=False))(chols[comp], eps)
        return state.means[comp] + noise

    def log_prob(state, x):
        """log q(x) for x of shape (d,) or (n, d)."""
        x = jnp.asarray(x, state.means.dtype)
        flat = x.reshape(-1, state.means.shape[1])
        chols = _chol(state.precisions, diagonal)
        out = logsumexp(_component_log_probs(flat, state.means, chols, diagonal) + log_weights(state.logits), -1)
        return out.reshape(x.shape[:-1])

    def weights(state):
        """Mixture weights :math:`\\pi = \\operatorname{softmax}(v)`."""
        return jax.nn.softmax(state.logits)

    return sample, log_prob, weights


# ----------------------------------------------------------------------------- mixture BLR


def mixture_blr(
    lr,
    num_components,
    *,
    weight_lr=None,
    covariance="full",
    hessian="autodiff",
    num_samples=1,
    precision_init=1.0,
    improved=True,
) -> MixtureFunctions:
    r"""Build the (improved) BLR for a mixture of ``num_components`` Gaussians (Lin, Khan & Schmidt 2019).

    Updates (module docstring for the derivation), per component :math:`c`, with
    :math:`f = \ell + \log q` and :math:`\mathbb E_c` estimated from samples of :math:`q` weighted
    by the responsibility ratio :math:`q(c\mid\theta)/\pi_c`:

    .. math::
        S_c &\leftarrow S_c + \rho G_c + \tfrac{\rho^2}{2} G_c S_c^{-1} G_c,\quad G_c = \mathbb E_c[\nabla^2 f],\\
        m_c &\leftarrow m_c - \rho S_c^{-1}\mathbb E_c[\nabla f],\qquad
        \log\tfrac{\pi_c}{\pi_K} \leftarrow \log\tfrac{\pi_c}{\pi_K} - \rho_\pi(\mathbb E_c[f] - \mathbb E_K[f]).

    Arguments: ``lr`` :math:`\rho` (number or schedule ``count -> rate``); ``weight_lr``
    :math:`\rho_\pi` (default ``lr``); ``covariance`` ``'full'`` or ``'diagonal'``; ``hessian``
    ``'autodiff'`` (exact :math:`\nabla^2\ell` at each sample; for ``'diagonal'`` its diagonal, from
    the full Hessian) or ``'price'`` (:math:`S_c(\theta - m_c)\nabla\ell^\top`, gradients only);
    ``num_samples`` draws per component and step; ``precision_init`` the initial :math:`S_c = s I`;
    ``improved`` adds the positivity-preserving second-order term (default; without it a step can
    leave the positive-definite cone and is then skipped).

    Returns a :class:`MixtureFunctions`:

    ``init(means, precisions=None, logits=None) -> MixtureState``
        ``means`` (K, d) (start them apart: components starting equal stay close for long).
    ``sample(key, state, n) -> (n, d)``, ``log_prob(state, x)``, ``weights(state) -> pi``.
    ``estimate(key, state, loss_fn, *args) -> (MixtureStats, loss)``
        the self-normalised importance-weighted estimates of :math:`\mathbb E_c[\nabla f]`,
        :math:`\mathbb E_c[\nabla^2 f]`, :math:`\mathbb E_c[f]`; ``loss`` is
        :math:`\mathbb E_q[\ell + \log q]`, the negative ELBO up to :math:`\log Z`.
    ``update(stats, state) -> MixtureState``
        the step; non-finite results are skipped (``nonfinite=True``, ``skipped += 1``).
    ``step(key, state, loss_fn, *args) -> (MixtureState, loss)``
        ``estimate`` then ``update``; jit-able (close over ``loss_fn``).
    """
    lr = _check_rate(lr, "lr")
    weight_lr = lr if weight_lr is None else _check_rate(weight_lr, "weight_lr")
    num_components = _check_int(num_components, "num_components")
    num_samples = _check_int(num_samples, "num_samples")
    if covariance not in COVARIANCES:
        raise ValueError(f"covariance must be one of {COVARIANCES}, got {covariance!r}.")
    if hessian not in HESSIANS:
        raise ValueError(f"hessian must be one of {HESSIANS}, got {hessian!r}.")
    precision_init = _check_rate(precision_init, "precision_init")
    if callable(precision_init):
        raise ValueError("precision_init must be a number.")
    diagonal = covariance == "diagonal"
    K, S = num_components, num_samples
    sample, log_prob, weights = _make_common(diagonal)

    def init(means, precisions=None, logits=None):
        return _init_state(means, precisions, logits, K, diagonal, precision_init)

    def estimate(key, state, loss_fn, *args):
        d = state.means.shape[1]
        dtype = state.means.dtype
        chols = _chol(state.precisions, diagonal)
        eps = jax.random.normal(key, (K, S, d), dtype)
        if diagonal:
            noise = eps / chols[:, None, :]
        else:
            noise = jnp.swapaxes(solve_triangular(jnp.swapaxes(chols, -1, -2), jnp.swapaxes(eps, -1, -2), lower=False), -1, -2)
        x = (state.means[:, None, :] + noise).reshape(K * S, d)
        log_pi = log_weights(state.logits)
        # mass of each (stratified) sample under q: pi_{c'} / S
        log_mass = jnp.repeat(log_pi, S) - math.log(S)

        fn = lambda th: loss_fn(th, *args)  # noqa: E731
        losses, grads = jax.vmap(jax.value_and_grad(fn))(x)
        log_q, log_n, a_bar, hess_q = _log_q_terms(x, state.means, state.precisions, chols, state.logits, diagonal)
        # alpha_{nc} ∝ (pi_{c'}/S) N_c(x_n)/q(x_n), self-normalised over n for each c
        log_alpha = log_mass[:, None] + log_n - log_q[:, None]
        alpha = jax.nn.softmax(log_alpha, axis=0)  # (n, K)
        f = losses + log_q
        value = alpha.T @ f
        grad = alpha.T @ (grads + a_bar)
        if hessian == "autodiff":
            h_l = jax.vmap(jax.hessian(fn))(x)
            if diagonal:
                h_l = jnp.diagonal(h_l, axis1=-2, axis2=-1)
            hess = jnp.einsum("nk,n...->k...", alpha, h_l + hess_q)
        else:
            diff = x[:, None, :] - state.means[None]  # (n, K, d)
            if diagonal:
                h_l = jnp.einsum("nk,nkd,nd->kd", alpha, state.precisions[None] * diff, grads)
            else:
                sd = jnp.einsum("kij,nkj->nki", state.precisions, diff)
                h_l = _sym(jnp.einsum("nk,nki,nj->kij", alpha, sd, grads))
            hess = h_l + jnp.einsum("nk,n...->k...", alpha, hess_q)
        loss = jnp.sum(jnp.exp(log_mass) * f)
        return MixtureStats(grad=grad, hess=hess, value=value), loss

    update = _make_update(lr, weight_lr, diagonal, improved)

    def step(key, state, loss_fn, *args):
        stats, loss = estimate(key, state, loss_fn, *args)
        return update(stats, state), loss

    return MixtureFunctions(
        init=init, sample=sample, log_prob=log_prob, weights=weights, estimate=estimate, update=update, step=step
    )


# ----------------------------------------------------------------------------- multimodal optimisation


def multimodal_optimization(
    lr,
    num_components,
    *,
    weight_lr=None,
    covariance="full",
    precision_init=1.0,
    improved=True,
    repulsion=False,
) -> MixtureFunctions:
    r"""Multimodal optimisation: the mixture-of-Gaussians BLR with the delta method (Khan & Rue 2023, Table 1).

    Every expectation :math:`\mathbb E_c[h]` is replaced by :math:`h(m_c)`, so with
    :math:`f = \ell + \log q`

    .. math::
        S_c &\leftarrow S_c + \rho G_c + \tfrac{\rho^2}{2} G_c S_c^{-1} G_c,\quad
            G_c = \nabla^2\ell(m_c) + \nabla^2\log q(m_c),\\
        m_c &\leftarrow m_c - \rho\, S_c^{-1}\big(\nabla\ell(m_c) + \nabla\log q(m_c)\big),\\
        v_c &\leftarrow v_c - \rho_\pi\big(f(m_c) - f(m_K)\big).

    For separated components this is :math:`K` improved Newton iterations in parallel
    (:math:`S_c \to \nabla^2\ell(m_c)`, always positive definite, so each step is a descent
    direction even at saddles and maxima, where plain Newton would be attracted), and
    :math:`\pi_c \to \propto e^{-\ell(m_c)}|S_c|^{-1/2}`. Overlapping components repel through
    :math:`\nabla\log q`. Exact Hessians by autodiff (``covariance='diagonal'`` keeps the diagonal).

    Returns a :class:`MixtureFunctions`; ``estimate(state, loss_fn, *args)`` and
    ``step(state, loss_fn, *args) -> (MixtureState, losses)`` take **no key** (the method is
    deterministic) and ``losses`` holds :math:`\ell(m_c)` for every component. Use :func:`modes`
    to read off the distinct minima.
    """
    lr = _check_rate(lr, "lr")
    weight_lr = lr if weight_lr is None else _check_rate(weight_lr, "weight_lr")
    num_components = _check_int(num_components, "num_components")
    if covariance not in COVARIANCES:
        raise ValueError(f"covariance must be one of {COVARIANCES}, got {covariance!r}.")
    precision_init = _check_rate(precision_init, "precision_init")
    if callable(precision_init):
        raise ValueError("precision_init must be a number.")
    diagonal = covariance == "diagonal"
    K = num_components
    sample, log_prob, weights = _make_common(diagonal)

    def init(means, precisions=None, logits=None):
        return _init_state(means, precisions, logits, K, diagonal, precision_init)

    def estimate(state, loss_fn, *args):
        fn = lambda th: loss_fn(th, *args)  # noqa: E731
        x = state.means
        losses, grads = jax.vmap(jax.value_and_grad(fn))(x)
        h_l = jax.vmap(jax.hessian(fn))(x)
        if diagonal:
            h_l = jnp.diagonal(h_l, axis1=-2, axis2=-1)
        chols = _chol(state.precisions, diagonal)
        if repulsion:
            log_q, _, a_bar, hess_q = _log_q_terms(x, state.means, state.precisions, chols, state.logits, diagonal)
            return MixtureStats(grad=grads + a_bar, hess=h_l + hess_q, value=losses + log_q), losses
        # separated components: log q(m_c) ~ log pi_c + log N_c(m_c), grad 0, Hessian -S_c
        log_det = jnp.sum(jnp.log(chols if diagonal else jnp.diagonal(chols, axis1=-2, axis2=-1)), -1)
        value = losses + log_weights(state.logits) + log_det
        return MixtureStats(grad=grads, hess=h_l - state.precisions, value=value), losses

    update = _make_update(lr, weight_lr, diagonal, improved)

    def step(state, loss_fn, *args):
        stats, losses = estimate(state, loss_fn, *args)
        return update(stats, state), losses

    return MixtureFunctions(
        init=init, sample=sample, log_prob=log_prob, weights=weights, estimate=estimate, update=update, step=step
    )


def modes(state, loss_fn=None, tol=1e-2):
    """Distinct component means (host-side helper, not jit-able).

    Means closer than ``tol`` (Euclidean) are merged, keeping the first; returns a numpy array
    (n_modes, d) sorted by ``loss_fn`` value if given, else by decreasing mixture weight.
    """
    means = np.asarray(state.means)
    order = np.argsort(-np.asarray(jax.nn.softmax(state.logits)))
    kept = []
    for i in order:
        if np.all(np.isfinite(means[i])) and all(np.linalg.norm(means[i] - means[j]) > tol for j in kept):
            kept.append(i)
    out = means[kept]
    if loss_fn is not None and len(out):
        vals = np.asarray(jax.vmap(loss_fn)(jnp.asarray(out)))
        out = out[np.argsort(vals)]
    return out


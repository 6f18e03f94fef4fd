r"""Table 1 of Khan & Rue (2023): every row a few lines composing a family, an estimator and a rule.

Rows over a NumPyro guide return a :class:`~numpyro_blr.BLR` (an SVI optimizer); rows over a
network's weights return an :class:`~numpyro_blr.core.Algorithm` (``init``/``step``/``sample``,
with ``nb.as_optax`` for Flax/Equinox loops and ``nb.IVON``/``nb.LieGroupBLR`` for SVI).

===============================  ==========================  ====================================  ======================
row                              posterior family            estimator (natural-gradient approx.)  rule
===============================  ==========================  ====================================  ======================
:func:`gradient_descent`         Gaussian, fixed covariance  delta method, no Hessian              BLR mean step
:func:`newton`                   Gaussian (full)             delta method, exact Hessian           plain BLR
:func:`laplace`                  Gaussian (full)             Newton to the mode, ``lr = 1``        plain BLR
:func:`von`                      Gaussian                    sampled Hessian (Price)               improved BLR
:func:`ivon`                     diagonal Gaussian           Price with weight noise               improved, diagonal
:func:`vogn`                     diagonal Gaussian           per-example Gauss-Newton at a sample  plain, diagonal
:func:`ogn`                      diagonal Gaussian           per-example Gauss-Newton at the mean  plain, diagonal
:func:`bsam`                     diagonal Gaussian           sharpness-aware gradient              plain, diagonal
:func:`adam_blr`                 diagonal Gaussian           squared gradient, delta               square-root, diagonal
:func:`rmsprop_blr`              diagonal Gaussian           squared gradient, delta               square-root, diagonal
:func:`sgd_blr`                  Gaussian, fixed covariance  gradient, delta                       mean step
:func:`mixture_blr`              mixture of Gaussians        responsibility-weighted Monte Carlo   natural, per component
:func:`multimodal_optimization`  mixture of Gaussians        delta method at each component        natural, per component
:func:`bayesbinn`                Bernoulli (:math:`\pm1`)    Gumbel-softmax relaxation             natural (Bernoulli)
:func:`lie_additive`             additive group x any q0     reparameterisation                    exponential map
:func:`lie_multiplicative`       multiplicative group x q0   reparameterisation                    exponential map
:func:`lie_affine`               diagonal affine group x q0  reparameterisation                    exponential map
===============================  ==========================  ====================================  ======================

Online Bayes (:mod:`numpyro_blr.online`): the posterior of one batch, time step or task is the prior of the next,
with the BLR's ``rho = 1`` (Bayes' rule on a stream):

======================================  ===========================  ====================================  ==========================
row                                     posterior family             estimator (natural-gradient approx.)  rule
======================================  ===========================  ====================================  ==========================
``online.Stream(model, "conjugate")``   conjugate exp. families      exact expectations (VMP messages)     ``rho = 1`` per batch
``online.Stream(model, guide)``         the guide's Gaussian         ``nb.BLR()``'s (or any optimizer's)   BLR fit per batch
``online.kalman_filter``                Gaussian (full), per time    delta + exact Hessian: Kalman         ``rho = 1`` after predict
                                                                     Gauss-Newton: (iterated) EKF
                                                                     cubature: posterior linearisation
``ivon(..., prior=...)``                diagonal Gaussian            Price with weight noise               improved, last task prior
``online.merge``                        diagonal Gaussian, product   the tasks' posterior precisions       ``rho = 1`` (Bayes' rule)
======================================  ===========================  ====================================  ==========================

Exact Bayes and message passing (``rho = 1`` on conjugate factors) are in
:func:`numpyro_blr.conjugate_fit` and :mod:`numpyro_blr.infer`.
"""

import math
import warnings

import numpy as np

from numpyro_blr.bayesbinn import BayesBiNNRule, bayesbinn_algorithm
from numpyro_blr.core import Algorithm, check_fraction, check_positive
from numpyro_blr.estimators import mixture as mixture_estimators
from numpyro_blr.estimators import relaxation, weights
from numpyro_blr.mixture import MixtureRule, mixture_algorithm
from numpyro_blr.optim import BLR
from numpyro_blr.rules.blr import positivity_rule
from numpyro_blr.rules.diagonal import DiagonalRule, diagonal_algorithm
from numpyro_blr.tree import NOISE_RNG


def gradient_descent(lr=0.01, momentum=0.0, **kwargs):
    r"""Gradient descent :math:`m \leftarrow m - \rho \nabla\ell(m)` (Khan & Rue 2023, Sec. 1.3).

    BLR with a Gaussian of fixed covariance (identity precision) and the delta method; the
    guide's scale is left untouched. With ``momentum`` it is heavy-ball gradient descent. The step
    is taken as given (``backtrack=False``: no damping of steps that raise the loss), as in the
    classic algorithm.
    """
    kwargs.setdefault("backtrack", False)
    return BLR(lr, hessian="none", delta=True, momentum=momentum, **kwargs)


def newton(lr=1.0, improved=False, **kwargs):
    r"""Newton's method :math:`S \leftarrow (1-\rho)S + \rho\nabla^2\ell(m)`, :math:`m \leftarrow m - \rho S^{-1}\nabla\ell(m)`.

    BLR with a full Gaussian, the delta method and the exact Hessian (Khan & Rue 2023, eq. 13).
    With ``lr=1`` it is Newton's method, and on a quadratic loss (a conjugate Gaussian model) one
    step gives the exact posterior mean and covariance. The plain BLR is used (``improved=False``)
    so that this holds; a step whose Hessian is not positive definite is then skipped as
    non-finite: pass ``improved=True`` to keep it positive definite instead.
    """
    return BLR(lr, hessian="autodiff", delta=True, improved=improved, **kwargs)


def laplace(**kwargs):
    r"""The Laplace approximation: Newton's method (``lr=1``) to the mode, covariance :math:`\nabla^2\ell(m)^{-1}`.

    With ``AutoMultivariateNormal`` the guide holds :math:`\mathcal{N}(m^*, \nabla^2\ell(m^*)^{-1})` once
    the iterations converge (a few steps for log-concave posteriors), which is NumPyro's
    ``AutoLaplaceApproximation`` computed by the BLR. Unlike :func:`newton` it uses the improved
    BLR by default: far from the mode (saturated logits, say) an undamped Newton step can jump
    away, while the improved step is damped there by its extra term
    :math:`\tfrac{\rho^2}{2} G S^{-1} G`, which vanishes at the fixed point
    :math:`S = \nabla^2\ell(m^*)`, so the converged approximation is the same.
    """
    kwargs.setdefault("lr", 1.0)
    kwargs.setdefault("improved", True)
    return newton(**kwargs)


def von(lr=None, momentum=0.0, **kwargs):
    r"""Variational online Newton (Khan et al. 2018; Khan & Rue 2023, eq. 12).

    :math:`S \leftarrow (1-\rho)S + \rho\,\hat H`, :math:`m \leftarrow m - \rho S^{-1}\hat g` with
    :math:`\hat g, \hat H` from one sample of the guide (Price's theorem), and the improved-BLR
    correction that keeps :math:`S` positive definite: ``nb.BLR(lr, hessian="reparam")``.

    ``lr=None`` (default) is ``nb.BLR()``'s step size: :math:`\rho` decays once the steps are noise
    and the Gaussian blocks are iterate-averaged (``docs/robustness.md``). A constant ``lr`` is the
    classic VON; its last iterate keeps the single-sample noise (on the robustness cases ``lr=0.1``
    ended 2-8 nats below the optimum after 1,000 steps, and 1,867 on unstandardised breast cancer).
    """
    return BLR(lr, hessian="reparam", delta=False, momentum=momentum, **kwargs)


# ----------------------------------------------------------------------------- deep-learning rows
# A diagonal Gaussian over a network's weights (numpyro_blr.rules.diagonal) x an estimator
# (numpyro_blr.estimators.weights) x the rule's options. Each returns a numpyro_blr.core.Algorithm:
# init(params), step(key, state, loss_fn, *batch) -> (DiagonalState, StepInfo), sample(key, state, n),
# update(state, estimate).


def _lr(lr):
    return lr if callable(lr) else check_positive(lr, "lr")


def _ess(ess):
    if ess is None:
        raise ValueError("ess (effective sample size) is required: set it to the number of training examples.")
    return check_positive(ess, "ess")


def _count(n, name):
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {n!r}.")
    return int(n)


def _state_dtype(state_dtype):
    """``state_dtype`` checked as far as it can be without the parameters (floating, not bfloat16/float16)."""
    from numpyro_blr.tree import state_dtype as resolve

    return None if state_dtype is None else resolve(None, state_dtype)


def _noise_rng(noise_rng):
    if noise_rng not in NOISE_RNG:
        raise ValueError(f"noise_rng must be one of {NOISE_RNG}, got {noise_rng!r}.")
    return noise_rng


def ivon(lr, ess=None, hess_init=1.0, beta1=0.9, beta2=0.99999, weight_decay=1e-4, mc_samples=1,
         hess_approx="price", clip_radius=float("inf"), rescale_lr=True, axis_name=None, vmap_samples=True,
         noise_rng="hash", state_dtype=None, prior=None) -> Algorithm:
    r"""IVON, the improved variational online Newton method (Shen et al. 2024, Algorithm 1).

    Diagonal Gaussian :math:`\mathcal N(m, 1/(N(h+\delta)))` x Price estimator with weight noise
    (``mc_samples`` draws, :func:`~numpyro_blr.estimators.weights.price`) x the improved-BLR precision
    step with :math:`\rho_2 = 1 - \beta_2`, momentum :math:`\beta_1` with bias correction, weight decay in
    the step, clipping at ``clip_radius`` and, with ``rescale_lr``, the learning rate scaled by
    :math:`h_0 + \delta`. The state's ``precision`` is :math:`h + \delta`. ``noise_rng``: ``"hash"``
    (:func:`~numpyro_blr.tree.hash_normal`, several times cheaper on CPU) or ``"jax"``.

    Mixed precision: bfloat16 or float16 parameters (and gradients) are accepted; the state (mean, precision,
    momentum) is then float32 and the loss sees the weights in the parameters' dtype. ``state_dtype`` overrides the
    state's dtype (float32 or wider; :func:`~numpyro_blr.tree.state_dtype`).

    Continual learning: ``prior`` puts a Gaussian prior in the state that replaces the weight decay
    (:class:`~numpyro_blr.rules.diagonal.DiagonalPrior`; True: the weight decay itself, as state). The previous task's
    posterior is the next one's prior with ``state = algo.init(state.params, prior=state.as_prior(ess=n_prev))``: the
    same jitted ``step`` trains every task. No prior (None) costs nothing.
    """
    from numpyro_blr.rules.diagonal import check_prior_option

    prior = check_prior_option(prior)
    ess, hess_init = _ess(ess), check_positive(hess_init, "hess_init")
    state_dtype = _state_dtype(state_dtype)
    delta = check_positive(weight_decay, "weight_decay", allow_zero=True)
    noise_rng = _noise_rng(noise_rng)
    rule = DiagonalRule(
        _lr(lr), check_fraction(beta1, "beta1"), check_fraction(beta2, "beta2"), "improved", delta,
        clip_radius=check_positive(clip_radius, "clip_radius", allow_inf=True),
        lr_scale=hess_init + delta if rescale_lr else 1.0,
    )
    estimator = weights.price(ess, _count(mc_samples, "mc_samples"), hess_approx, vmap_samples, noise_rng)
    return diagonal_algorithm(estimator, rule, hess_init + delta, ess, axis_name, noise_rng, state_dtype, prior)


def vogn(lr, ess=None, weight_decay=1e-4, beta1=0.9, beta2=0.999, hess_init=1.0, mc_samples=1, axis_name=None,
         prior=None) -> Algorithm:
    r"""VOGN, variational online Gauss-Newton (Khan et al. 2018, eq. 12; Osawa et al. 2019).

    Diagonal Gaussian :math:`\mathcal N(\mu, 1/(N(s+\delta)))` x per-example Gauss-Newton at weight
    samples (``step(key, state, per_example_loss, *batch)``, batch arrays with a leading example axis)
    x the plain precision step (an average of squares is never negative), momentum with bias
    correction and weight decay in the step. The state's ``precision`` is :math:`s + \delta`. ``prior``: the
    previous task's posterior as the prior (continual learning), as in :func:`ivon`.
    """
    from numpyro_blr.rules.diagonal import check_prior_option

    prior = check_prior_option(prior)
    ess, delta = _ess(ess), check_positive(weight_decay, "weight_decay", allow_zero=True)
    rule = DiagonalRule(_lr(lr), check_fraction(beta1, "beta1"), check_fraction(beta2, "beta2"), "plain", delta)
    estimator = weights.gauss_newton(ess, _count(mc_samples, "mc_samples"))
    return diagonal_algorithm(estimator, rule, check_positive(hess_init, "hess_init") + delta, ess, axis_name,
                              prior=prior)


def ogn(lr, weight_decay=1e-4, beta1=0.9, beta2=0.999, hess_init=1.0, axis_name=None) -> Algorithm:
    """OGN: :func:`vogn`'s update at the mean (the delta method: no weight sampling; ``sample`` returns the mean)."""
    delta = check_positive(weight_decay, "weight_decay", allow_zero=True)
    rule = DiagonalRule(_lr(lr), check_fraction(beta1, "beta1"), check_fraction(beta2, "beta2"), "plain", delta)
    return diagonal_algorithm(weights.gauss_newton(None), rule, check_positive(hess_init, "hess_init") + delta, None, axis_name)


def bsam(lr, ess=None, radius=0.01, beta1=0.9, beta2=0.999, weight_decay=1e-4, damping=0.1, s_init=1.0, msharpness=1,
         *, rho=None) -> Algorithm:
    r"""Bayesian SAM (Moellenhoff & Khan 2023, Algorithm 1).

    Diagonal Gaussian :math:`\mathcal N(w, 1/(Ns))` x the sharpness-aware estimator (gradient at the
    adversarial point :math:`w + r g/s`, curvature :math:`\sqrt s|g| + \gamma`;
    :func:`~numpyro_blr.estimators.weights.sharpness_aware`) x the plain precision step, weight decay
    in the momentum and no bias correction. ``radius`` :math:`r` is the SAM neighbourhood (the
    paper's :math:`\rho`; here :math:`\rho` is the BLR step size, ``lr``). ``rho=`` is the former
    name of ``radius``, still accepted with a ``DeprecationWarning``.
    """
    ess = _ess(ess)
    if rho is not None:
        warnings.warn("bsam(rho=...) is now bsam(radius=...): rho is the BLR step size across the package.",
                      DeprecationWarning, stacklevel=2)
        radius = rho
    rho = check_positive(radius, "radius", allow_zero=True)
    damping = check_positive(damping, "damping", allow_zero=True)
    rule = DiagonalRule(
        _lr(lr), check_fraction(beta1, "beta1"), check_fraction(beta2, "beta2"), "plain",
        check_positive(weight_decay, "weight_decay", allow_zero=True), decay_in_momentum=True, debias=False,
    )
    estimator = weights.sharpness_aware(ess, rho, damping, _count(msharpness, "msharpness"))
    return diagonal_algorithm(estimator, rule, check_positive(s_init, "s_init"), ess)


def sgd_blr(lr, momentum=None, nesterov=False) -> Algorithm:
    r"""SGD as the BLR: a Gaussian of fixed covariance x the delta method (Khan & Rue 2023, Sec. 1.3).

    :math:`\lambda = m` and the BLR is :math:`m \leftarrow m - \rho\nabla\ell(m)`; heavy-ball momentum is
    optax's ``trace``. Reproduces ``optax.sgd(lr, momentum, nesterov)`` given the same gradients.
    """
    beta1 = 0.0 if momentum is None else check_fraction(momentum, "momentum")
    rule = DiagonalRule(_lr(lr), beta1, None, heavy_ball=True, nesterov=bool(nesterov))
    return diagonal_algorithm(weights.gradient(), rule, 1.0)


def adam_blr(lr, b1=0.9, b2=0.999, eps=1e-8) -> Algorithm:
    r"""Adam as the BLR (Khan & Rue 2023, Sec. 4.2): diagonal Gaussian x the delta method with the
    squared gradient as curvature x the plain precision step (:math:`\rho_2 = 1 - b_2`, a
    "slow-moving" scale) with the square-root scaling :math:`1/(\sqrt{p} + \epsilon)`, momentum
    :math:`b_1`, both bias-corrected. The precision is the natural parameter
    :math:`p = -2\lambda_2` (optax's second moment :math:`\nu`). Reproduces ``optax.adam(lr, b1, b2, eps)``.
    """
    rule = DiagonalRule(
        _lr(lr), check_fraction(b1, "b1"), check_fraction(b2, "b2"), "plain", debias_precision=True,
        sqrt_precision=True, eps=check_positive(eps, "eps", allow_zero=True),
    )
    return diagonal_algorithm(weights.gradient(squared=True), rule, 0.0)


def rmsprop_blr(lr, decay=0.9, eps=1e-8) -> Algorithm:
    """RMSprop as the BLR: :func:`adam_blr` without momentum or bias correction, ``eps`` inside the root
    (reproduces ``optax.rmsprop(lr, decay, eps)``)."""
    rule = DiagonalRule(
        _lr(lr), 0.0, check_fraction(decay, "decay"), "plain", sqrt_precision=True,
        eps=check_positive(eps, "eps", allow_zero=True), eps_in_sqrt=True,
    )
    return diagonal_algorithm(weights.gradient(squared=True), rule, 0.0)


# ----------------------------------------------------------------------------- beyond one Gaussian
# families.mixture x estimators.mixture x rules.blr.gaussian_update per component (mixture.mixture_update);
# families.SignBernoulli x estimators.relaxation x rules.blr.natural_update (bayesbinn.bayesbinn_update).


def mixture_blr(lr=None, num_components=None, *, weight_lr=None, covariance="full", hessian="autodiff", num_samples=1,
                precision_init=1.0, improved=True, backtrack=True) -> Algorithm:
    r"""The (improved) BLR for a mixture of Gaussians (Lin, Khan & Schmidt 2019; :mod:`numpyro_blr.mixture`):
    ``num_samples`` draws per component, ``hessian`` ``'autodiff'`` or ``'price'``; ``covariance`` ``'full'`` or
    ``'diagonal'``; :math:`S_c = s I` initially (``precision_init``); ``improved`` the positivity rule (``False``:
    plain). ``num_components`` :math:`K` defaults to the number of rows of the means given to ``init`` (given, it is
    checked against them). ``StepInfo.loss`` is :math:`\mathbb E_q[\ell + \log q]`.

    ``lr`` (components) and ``weight_lr`` (weights; default ``lr``): numbers > 0, schedules ``count -> rate``, or an
    :class:`~numpyro_blr.rules.schedules.adaptive_decay`. Default (``lr=None``): ``nb.BLR()``'s adaptive clock
    without averaging, :math:`\rho_t = \rho_0/(1 + c_t/\tau)` with :math:`\rho_0 = 1/2`, :math:`\tau = 10`
    (``hessian='price'`` with full covariances: :math:`\rho_0 = \min(1/2, 1/d)`, :math:`\tau = 100`, as
    ``nb.BLR``'s :meth:`~numpyro_blr.BLR.default_lr`), where the clock :math:`c_t` advances by :math:`\min(1, 2f_t)`,
    :math:`f_t` the size-weighted fraction of sign changes between successive whitened steps (Kesten 1958; Delyon &
    Juditsky 1993), each component's block weighted by :math:`\pi_c` (the joint family's Fisher metric): it stands
    still while the fit travels and counts about one per step once the steps are Monte Carlo noise, so the rate then
    decays like Robbins & Monro's :math:`\rho_0\tau/t` (:func:`numpyro_blr.rules.schedules.clock_advance`).

    ``backtrack`` (default on, as ``nb.BLR()``'s): each component's mean step is shortened by factors of 4 (down to
    none) when it raises that component's sample of :math:`\mathbb E_c[\ell]` at the step's draws (common random
    numbers, control variate included; damped Newton, Nocedal & Wright 2006, Sec. 3.1;
    :func:`numpyro_blr.estimators.mixture.mean_backtracking`): one loss evaluation per component, draw and try.

    A component whose own draws give a non-finite loss, gradient or Hessian (or whose update is not finite) is held
    (returned to its best iterate, its step sizes halved) while the others step; a step where none can step is
    skipped, returns to the best iterate and halves every step size. After the loop, ``numpyro_blr.mixture.check(state)`` warns about skipped steps, held
    components, a diverged run or a loss still falling."""
    if lr is not None and not callable(lr):
        lr = check_positive(lr, "lr")
    if weight_lr is not None and not callable(weight_lr):
        weight_lr = check_positive(weight_lr, "weight_lr")
    if hessian not in mixture_estimators.HESSIANS:
        raise ValueError(f"hessian must be one of {mixture_estimators.HESSIANS}, got {hessian!r}.")
    rule = MixtureRule(lr, lr if weight_lr is None else weight_lr, positivity_rule(improved), hessian == "price")
    num_samples = _count(num_samples, "num_samples")
    estimator = mixture_estimators.reparam(hessian, num_samples)
    line_search = mixture_estimators.mean_backtracking(num_samples) if backtrack else None
    num_components = None if num_components is None else _count(num_components, "num_components")
    precision_init = check_positive(precision_init, "precision_init")
    return mixture_algorithm(estimator, rule, num_components, covariance, precision_init, line_search)


def multimodal_optimization(lr, num_components, *, weight_lr=None, covariance="full", precision_init=1.0,
                            improved=True, repulsion=False) -> Algorithm:
    r"""Multimodal optimisation (Khan & Rue 2023, Table 1): :func:`mixture_blr` with the delta method at each mean
    (``repulsion``: exact :math:`\log q` there). ``step(None, state, loss_fn)``; ``StepInfo.loss`` is :math:`\ell(m_c)`
    per component; :func:`numpyro_blr.mixture.modes` reads off the distinct minima. Skipped steps as :func:`mixture_blr`;
    ``numpyro_blr.mixture.check(state, "nb.multimodal_optimization")`` reports them after the loop."""
    rule = MixtureRule(_lr(lr), _lr(lr if weight_lr is None else weight_lr), positivity_rule(improved))
    return mixture_algorithm(mixture_estimators.delta(repulsion), rule, _count(num_components, "num_components"),
                             covariance, check_positive(precision_init, "precision_init"))


def bayesbinn(lr, ess, temperature=1.0, beta=0.0, mc_samples=1, lam_init=10.0, lam_std=0.0, reweight=1.0,
              max_scale=1e10) -> Algorithm:
    r"""BayesBiNN (Meng, Bachmann & Khan 2020; :mod:`numpyro_blr.bayesbinn`): ``mc_samples`` relaxed draws at
    ``temperature``, ``ess`` :math:`N` (``loss_fn`` is the *mean* mini-batch loss), momentum ``beta`` (reference
    default 0), KL weight ``reweight``. ``init(key, params, prior_lam=None)`` starts :math:`\lambda` at
    :math:`\pm(\lambda_{\rm init} + \sqrt{\lambda_{\rm std}}\epsilon)`, random signs; ``sample`` draws exact weights."""
    rule = BayesBiNNRule(_lr(lr), check_fraction(beta, "beta"), check_positive(reweight, "reweight", allow_zero=True))
    estimator = relaxation.gumbel_softmax(_ess(ess), check_positive(temperature, "temperature"),
                                          _count(mc_samples, "mc_samples"), check_positive(max_scale, "max_scale"))
    return bayesbinn_algorithm(estimator, rule, check_positive(lam_init, "lam_init", allow_zero=True),
                               check_positive(lam_std, "lam_std", allow_zero=True))


# ----------------------------------------------------------------------------- Lie-group rows
# The Lie-group BLR (Kiral, Moellenhoff & Khan 2023): a group acting on a base distribution q0
# (numpyro_blr.rules.liegroup) x the reparameterisation estimator of its algebra gradient
# (numpyro_blr.estimators.liegroup) x the exponential-map step. Same Algorithm shape as the rows above.


def lie_additive(lr, momentum=0.0, base=None, weight_decay=0.0, nesterov=False, mc_samples=1,
                 noise_rng="hash", state_dtype=None) -> Algorithm:
    r"""The additive Lie-group BLR (Kiral et al. 2023, Algorithm 1): :math:`\theta = w + \xi`, :math:`\xi \sim q_0`
    fixed (``base``, e.g. ``dist.Normal(0, 1e-3)``; ``None``: a Dirac :math:`q_0`), and ``optax.sgd``'s step on
    :math:`w` with the gradient at :math:`\theta` plus ``weight_decay`` :math:`\delta\theta`. With ``base=None``
    it is ``optax.sgd(lr, momentum, nesterov)`` exactly. ``state.params`` is :math:`w + \mathbb E[\xi]`.
    bfloat16/float16 parameters keep a float32 state (``state_dtype``, as in :func:`ivon`); so do the other groups."""
    from numpyro_blr.estimators import liegroup as est
    from numpyro_blr.rules import liegroup as lie

    lie.check_base(base, "lie_additive: base", "additive")
    rule = lie.AdditiveRule(_lr(lr), check_fraction(momentum, "momentum"), bool(nesterov))
    delta = check_positive(weight_decay, "weight_decay", allow_zero=True)
    estimator = est.additive(base, delta, _count(mc_samples, "mc_samples"), _noise_rng(noise_rng))
    mu, sd = lie.base_mean(base), _state_dtype(state_dtype)
    return lie.liegroup_algorithm("additive", estimator, rule, lambda params: lie.init_additive(params, mu, sd))


def lie_multiplicative(lr, ess=None, base=None, momentum=0.9, temperature=1.0, weight_decay=0.0, signed=True,
                       metric="fisher", init_offset=1e-5, clip_radius=float("inf"), mc_samples=1,
                       noise_rng="hash", state_dtype=None) -> Algorithm:
    r"""The multiplicative Lie-group BLR (Kiral et al. 2023, Algorithm 2): :math:`\theta = g_+\xi_+ - g_-\xi_-`
    (``signed``, each weight excitatory or inhibitory; ``signed=False``: :math:`g\xi`, positive weights only),
    :math:`\xi \sim q_0` positive (``base``, default :class:`~numpyro_blr.rules.liegroup.Rayleigh` (1)), and
    :math:`g \leftarrow g\exp(-\rho M)` with :math:`M` the momentum (:math:`\beta` = ``momentum``) of the
    algebra gradient in per-example units, :math:`(\mathbb E[\pm g\xi G] - T/N)/c`, :math:`N` = ``ess``,
    :math:`T` = ``temperature`` (0: no entropy term), :math:`c` the Fisher ``metric`` of :math:`q_0` (4 for
    Rayleigh). ``init``
    puts :math:`\mathbb E_q[\theta]` at the given weights (:math:`g_\pm = \max(\pm w, 0)/\mathbb E[\xi]` plus
    ``init_offset``); ``state.params`` is :math:`\mathbb E[\xi](g_+ - g_-)`. ``clip_radius`` :math:`r` bounds the
    change of :math:`\log g` in one step (:math:`|\rho M| \le r`; default none, as in the paper): large steps of
    the exponential map grow a weight by :math:`e^{\rho M}`, and the growth feeds back into :math:`M`."""
    from numpyro_blr.estimators import liegroup as est
    from numpyro_blr.rules import liegroup as lie

    base = lie.Rayleigh() if base is None else base
    lie.check_base(base, "lie_multiplicative: base", "multiplicative")
    _, c = lie.resolve_metric(metric, base, "multiplicative")
    rule = lie.MultiplicativeRule(_lr(lr), check_fraction(momentum, "momentum"), c,
                                  check_positive(clip_radius, "clip_radius", allow_inf=True))
    estimator = est.multiplicative(
        base, _ess(ess), check_positive(temperature, "temperature", allow_zero=True),
        check_positive(weight_decay, "weight_decay", allow_zero=True), _count(mc_samples, "mc_samples"),
        bool(signed), _noise_rng(noise_rng),
    )
    mu, sd = lie.base_mean(base), _state_dtype(state_dtype)
    init_offset = check_positive(init_offset, "init_offset")
    return lie.liegroup_algorithm(
        "multiplicative", estimator, rule,
        lambda params: lie.init_multiplicative(params, mu, bool(signed), init_offset, sd),
    )


def lie_affine(lr, ess=None, scale_lr=None, base=None, scale_init=None, momentum=0.9, scale_momentum=0.999,
               temperature=1.0, weight_decay=0.0, metric="fisher", clip_radius=float("inf"), mc_samples=1,
               noise_rng="hash", state_dtype=None) -> Algorithm:
    r"""The diagonal affine Lie-group BLR (Kiral et al. 2023, Algorithm 3): :math:`\theta = b + A\epsilon`,
    :math:`\epsilon \sim q_0` (``base``, default ``dist.Normal(0, 1)``; any reparameterisable univariate
    distribution: ``dist.StudentT(3.0)``, ``dist.Laplace()``, ...), and the closed-form exponential map
    :math:`A \leftarrow A e^{-z}`, :math:`b \leftarrow b - \rho A M_b\varphi(z)`, :math:`z = \rho_A M_A`, with
    momenta ``momentum`` (shift) and ``scale_momentum`` (scale) of the natural algebra gradient
    :math:`X_b = \tfrac{N}{T}A\,\mathbb E[G]/c_b`, :math:`X_A = (\tfrac{N}{T}\mathbb E[A\epsilon G] - 1)/c_A`.
    ``scale_lr`` :math:`\rho_A` defaults to ``lr``; ``scale_init`` :math:`A_0` (a number or a pytree like the
    parameters, strictly positive) defaults to :math:`1/\sqrt N` (a per-example precision of 1 for a unit
    :math:`q_0`). With a Gaussian :math:`q_0`, to first order in the step it is the diagonal Gaussian BLR
    with step :math:`\rho`. ``state.params`` is :math:`b + A\,\mathbb E[\epsilon]`. ``clip_radius`` :math:`r` bounds
    the change of :math:`\log A` in one step (default none, as in the paper)."""
    import numpyro.distributions as dist

    from numpyro_blr.estimators import liegroup as est
    from numpyro_blr.rules import liegroup as lie

    base = dist.Normal(0.0, 1.0) if base is None else base
    lie.check_base(base, "lie_affine: base", "affine")
    c_loc, c_scale = lie.resolve_metric(metric, base, "affine")
    ess = _ess(ess)
    rule = lie.AffineRule(
        _lr(lr), _lr(lr if scale_lr is None else scale_lr), check_fraction(momentum, "momentum"),
        check_fraction(scale_momentum, "scale_momentum"), c_loc, c_scale,
        check_positive(clip_radius, "clip_radius", allow_inf=True),
    )
    estimator = est.affine(
        base, ess, check_positive(temperature, "temperature"),
        check_positive(weight_decay, "weight_decay", allow_zero=True), _count(mc_samples, "mc_samples"),
        _noise_rng(noise_rng),
    )
    mu = lie.base_mean(base)
    scale_init = ess**-0.5 if scale_init is None else scale_init
    if isinstance(scale_init, (int, float)) and not isinstance(scale_init, bool):
        if not (math.isfinite(float(scale_init)) and float(scale_init) > 0):
            raise ValueError(f"lie_affine: scale_init must be strictly positive and finite, got {scale_init!r}.")
    sd = _state_dtype(state_dtype)
    return lie.liegroup_algorithm("affine", estimator, rule, lambda params: lie.init_affine(params, scale_init, mu, sd))

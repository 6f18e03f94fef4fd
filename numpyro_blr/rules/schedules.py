r"""Step sizes :math:`\rho_t` of the Bayesian learning rule, and the checks on them.

* :func:`harmonic_decay`: the Robbins-Monro :math:`\rho_0/(1 + t/\tau)`;
* :class:`adaptive_decay`: the default of ``nb.BLR``, the same decay on a clock that only counts
  noise-dominated steps (Kesten's rule), with Polyak-Ruppert averaging of the iterates;
* :func:`check_step_size`: a float or an optax schedule in :math:`(0, 1]` at every step, checked
  before any step runs; :func:`check_lr`, :func:`check_unit_interval`: argument checks with
  messages that name the argument.

Names: ``init_value`` :math:`\rho_0`, ``halving_steps`` :math:`\tau`, ``clock`` :math:`c`.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np


def check_lr(lr, name="lr"):
    """A positive finite float, or a schedule (a callable step -> step size) positive at step 0."""
    if callable(lr) and not isinstance(lr, type):
        try:
            first = float(lr(0))
        except Exception as err:  # noqa: BLE001 - any failure means it is not a schedule
            raise ValueError(f"{name} is callable but not a schedule step -> step size: calling it at 0 failed ({err}).") from err
        if not math.isfinite(first) or first <= 0:
            raise ValueError(f"{name} schedule must give positive finite step sizes, got {first} at step 0.")
        return lr
    if isinstance(lr, bool) or not isinstance(lr, (int, float, np.floating, np.integer)):
        raise ValueError(
            f"{name} must be a positive finite float or an optax schedule (a callable step -> step size), "
            f"got {lr!r} of type {type(lr).__name__}."
        )
    if not math.isfinite(lr) or lr <= 0:
        raise ValueError(f"{name} must be positive and finite, got {lr!r}.")
    return float(lr)


SCHEDULE_CHECK_STEPS = 1_000_000


def check_step_size(lr):
    """The BLR's step size :math:`\rho`: in (0, 1] at every step. :math:`\rho = 1` replaces the natural
    parameters by the new estimate (a Newton step, exact Bayes on a conjugate model); :math:`\rho > 1`
    gives the old ones a negative weight and extrapolates past it, which the precision step cannot
    keep stable. A schedule is checked over its first ``SCHEDULE_CHECK_STEPS`` steps, before any step
    runs, so that it cannot turn negative, non-finite or above 1 in the middle of a run."""
    lr = check_lr(lr)
    if not callable(lr):
        if lr > 1.0:
            raise ValueError(
                f"lr={lr!r} is outside (0, 1]: the BLR's step size weighs the new estimate against the old "
                "natural parameters, and lr > 1 gives the old ones a negative weight (unstable). Use lr <= 1 "
                "(lr=1 is a full Newton step), or leave lr unset for the adaptive default."
            )
        return lr
    steps = np.arange(SCHEDULE_CHECK_STEPS)
    try:
        values = np.asarray(jax.device_get(jax.jit(jax.vmap(lr))(jnp.asarray(steps))), dtype=float)
    except Exception:  # noqa: BLE001 - a schedule written for scalars only: check a geometric grid
        steps = np.unique(np.geomspace(1, SCHEDULE_CHECK_STEPS, 2000).astype(int) - 1)
        values = np.array([float(lr(int(t))) for t in steps])
    bad = ~np.isfinite(values) | (values <= 0) | (values > 1)
    if np.any(bad):
        first = int(np.argmax(bad))
        raise ValueError(
            f"the lr schedule gives {float(values[first])!r} at step {int(steps[first])}: the BLR's step size must stay "
            "in (0, 1] at every step (checked over the first "
            f"{SCHEDULE_CHECK_STEPS:,} steps). Clip the schedule, e.g. optax.schedules with an end value > 0, "
            "or leave lr unset for the adaptive default."
        )
    return lr


def check_unit_interval(x, name):
    if isinstance(x, bool) or not isinstance(x, (int, float, np.floating, np.integer)) or not (0.0 <= x < 1.0):
        raise ValueError(f"{name} must be a float in [0, 1), got {x!r}.")
    return float(x)



def harmonic_decay(init_value=0.5, halving_steps=10):
    r"""The Robbins-Monro step size :math:`\rho_t = \rho_0 / (1 + t/\tau)` (``tau = halving_steps``).

    :math:`\rho_t` halves after ``halving_steps`` steps, and decays like :math:`\rho_0\tau/t`, so
    the natural parameters become a weighted average of the per-step estimates
    (Khan & Rue 2023, Sec. 3: the BLR with :math:`\rho_t \propto 1/t` averages the "new
    information"), which removes the Monte Carlo noise that a constant :math:`\rho` leaves.
    """
    init_value = check_lr(init_value, "init_value")
    halving_steps = check_lr(halving_steps, "halving_steps")

    def schedule(count):
        return init_value / (1.0 + count / halving_steps)

    return schedule


def clock_advance(direction, previous, count):
    r"""Kesten's rule (Kesten 1958; multivariate: Delyon & Juditsky 1993), the advance of
    :class:`adaptive_decay`'s clock: :math:`\min(1, 2f)`, :math:`f = \sum_j (-p_j)_+ / \sum_j |p_j|` the
    size-weighted fraction of the products :math:`p_j` of successive whitened steps' coordinates that are
    negative (0 on the first step, ``count`` 0): one coordinate still travelling (a scale whose precision is
    far too high) outweighs many that are noise, and a small bias in noisy coordinates only slows the clock.
    About 0 while the fit travels, about 1 per step once its steps are Monte Carlo noise around the optimum."""
    products = direction * previous
    total = jnp.sum(jnp.abs(products))
    changed = jnp.where(total > 0, jnp.sum(jnp.maximum(-products, 0.0)) / jnp.where(total > 0, total, 1.0), 1.0)
    return jnp.where(count > 0, jnp.minimum(1.0, 2.0 * changed), 0.0)


class adaptive_decay:  # noqa: N801 - used like a schedule function
    r"""The default step size: a Robbins-Monro decay on a clock that only counts noise-dominated steps,
    with iterate averaging (Polyak & Juditsky 1992).

    The clock :math:`c` advances at each step by
    :math:`\min(1, 2f)`, where :math:`f = \sum_j (-p_j)_+ / \sum_j |p_j|`, :math:`p_j = v_j v'_j` the
    products of the coordinates of the whitened step :math:`v` (:math:`L^\top\hat g` for the mean,
    :math:`\operatorname{diag}(L^\top \hat H L) - 1` for the precision) and of the previous one
    :math:`v'`: the size-weighted fraction of coordinates whose sign changed. This is Kesten's rule (Kesten 1958;
    multivariate: Delyon & Juditsky 1993): while the fit is still travelling, successive steps
    point the same way (:math:`f \approx 0`) and the clock stands still, so early estimates taken far
    from the posterior are forgotten geometrically; once the steps are Monte Carlo noise around the
    optimum, about half the signs change and the clock advances by about one per step.

    With ``averaging=True`` (the default) the Gaussian blocks step with
    :math:`\rho = \rho_0 / \sqrt{1 + c/\tau}` and the guide that :meth:`BLR.get_params` returns is the
    average of these iterates :math:`\bar x \leftarrow \bar x + \gamma\,(x - \bar x)` with weight
    :math:`\gamma = \rho_0 / (1 + c/\tau) = a/(\tau + c)`, :math:`a = \rho_0\tau` (:meth:`__call__`),
    which decays like :math:`a/t` and averages the Monte Carlo noise away. While the clock stands
    still the average follows the iterate with that weight (0.5 at :math:`c = 0`: one step behind).
    Once it counts one unit per step, the iterate taken at clock :math:`c_s` carries weight
    :math:`\propto (\tau + c_s - a + 1)\cdots(\tau + c_s - 1)`, a polynomial of degree :math:`a - 1`
    (:math:`(c_s + 6)(c_s + 7)(c_s + 8)(c_s + 9)` for the default :math:`a = 5`, :math:`\tau = 10`;
    Shamir & Zhang 2013's polynomial-decay averaging): the iterates from before clock :math:`c_0` keep
    a share of about :math:`((c_0 + \tau - a/2)/(c + \tau - a/2))^a` (2.6e-4 at :math:`c = 80` of those
    before :math:`c_0 = 10`, where the fit has usually arrived), and its variance on independent noise
    is :math:`a^2/(2a - 1)` = 2.8 times the plain mean's. So the error left after 100 steps is Monte
    Carlo noise, not the approach: on breast cancer (``bench/bench_steps.py --floor``) even the plain
    mean of 100 independent one-sample steps started at the optimum is 0.057 NUTS-sd off (median over
    replicates of the largest error of 31 coefficients), against 0.05-0.17 for the default over ten
    seeds. Weights closer to uniform (:math:`a` = 1-2, or restarting the average when the clock first
    passes a threshold) cut that noise by a fifth to a third, but keep more of a late approach: a
    restart at :math:`c = 10` left ``AutoNormal`` on the rescaled regressions of the robustness bench
    :math:`10^3`-:math:`10^{10}` nats short at step 500 (the clock counts to 13 while the fit is still
    stuck far out, and it arrives some 100 steps later); :math:`2/(2 + c)` kept all of them but took
    float32's raw breast cancer from 60 to 180 steps to NUTS quality and moved float32's negative
    binomial regression below the bench's sd criterion (``docs/blr.md`` Section 5).
    The slower :math:`t^{-1/2}` decay of the iterate's own step keeps it moving along directions
    where the fixed-point iteration contracts slowly (funnels, heavy-tailed scales), where a
    :math:`\rho_0\tau/t` step would cover a distance growing only like :math:`\log t` (Bach & Moulines
    2011: the :math:`t^{-1/2}` step with averaging is the choice robust to the conditioning).
    With ``averaging=False`` every block steps with :math:`\gamma` itself and no average is kept
    (the previous default). A step with a non-finite loss, gradient or update is skipped
    and halves the iterate's step :math:`\rho` (the clock jumps so that
    :math:`1 + c/\tau` is multiplied by :math:`2^{1/\kappa}`, :math:`\kappa` = ``power``).
    """

    adaptive = True

    def __init__(self, init_value=0.5, halving_steps=10, averaging=True):
        self.init_value = check_lr(init_value, "init_value")
        self.halving_steps = check_lr(halving_steps, "halving_steps")
        if not isinstance(averaging, (bool, np.bool_)):
            raise ValueError(f"averaging must be True or False, got {averaging!r}.")
        self.averaging = bool(averaging)
        # exponent of the iterate's step: t^-1/2 with averaging, t^-1 (the weight itself) without
        self.power = 0.5 if self.averaging else 1.0

    def __call__(self, clock):
        r""":math:`\gamma = \rho_0/(1 + c/\tau)`: the averaging weight (the step itself without averaging)."""
        return self.init_value / (1.0 + clock / self.halving_steps)

    def iterate(self, clock):
        r""":math:`\rho = \rho_0/(1 + c/\tau)^\kappa`: the step of the averaged (Gaussian) blocks."""
        if self.power == 1.0:
            return self(clock)
        return self.init_value * (1.0 + clock / self.halving_steps) ** -self.power

    def skipped(self, clock):
        r"""The clock after a skipped step: :math:`1 + c/\tau` times :math:`2^{1/\kappa}`, which halves
        :meth:`iterate` (:math:`2c + \tau` without averaging, :math:`4c + 3\tau` with it)."""
        factor = 2.0 ** (1.0 / self.power)
        return factor * clock + (factor - 1.0) * self.halving_steps

    def __repr__(self):
        extra = "" if self.averaging else ", averaging=False"
        return f"adaptive_decay({self.init_value}, {self.halving_steps}{extra})"

r"""Data-parallel BLR, IVON and stochastic VI with JAX's own sharding (no communication layer of our own).

Every estimator of the BLR is an expectation over the data: the ELBO's likelihood is a sum over a
plate, so its gradient and Hessian statistics are sums of per-shard partial sums. Placing the data
along the plate dimension on a device ``Mesh`` and the parameters and optimizer state replicated,
``jax.jit`` (GSPMD) compiles the unchanged SVI step into one program per device and inserts the
reduction itself; XLA's all-reduce combiner merges the partial loss, gradient and Hessian into one
all-reduce (measured: :func:`collective_counts`, ``tests/parallel/test_scale.py``)::

    mesh = nb.data_mesh()                              # all devices, axis "data"
    X, y = nb.shard_data(mesh, X, y, model=model)      # the plate dimension split over the devices
    svi = SVI(model, AutoMultivariateNormal(model), nb.BLR(), Trace_ELBO())
    result = svi.run(key, 500, X, y)                   # params come back replicated

This is the *shared-key* mode: every device evaluates the same draw of the guide on its shard, and
the fit equals the single-device fit to float rounding. The *per-device-sample* mode (IVON's
multi-GPU training) is :func:`data_parallel_step` with ``per_device_sample=True`` for the
deep-learning rows built with ``axis_name`` (``nb.ivon(..., axis_name="data")``): inside
``shard_map`` each device folds its index into the key, draws its own weights, and the gradient and
curvature estimates are ``lax.pmean``-ed (one reduction), so a step averages as many weight samples
as there are devices.

Several processes (hosts): :func:`initialize` (``jax.distributed.initialize``, with JAX's gloo CPU
collectives on CPU) in every process, then the same code; :func:`shard_data` assembles each process's
local rows into one global array (``jax.make_array_from_process_local_data``). :func:`launch_local`
starts and stops the processes of a local run.

Memory: a full-covariance guide holds :math:`D \times D` matrices on every device (they are
replicated); :func:`check_guide_memory` (called by the optimizers' ``init``) raises before any step
when they cannot fit, naming :math:`D`, the bytes needed and the memory the device has.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DATA_AXIS = "data"

# How many D x D matrices one BLR step over a full-covariance block holds at once (arguments,
# outputs and XLA's temporaries), measured with jax's compiled memory_analysis() of svi.update on
# CPU for D = 64..512 (AutoMultivariateNormal, logistic regression): 13.1-13.5 ("price"),
# 17.1-18.1 ("autodiff", the default for D <= 256), 18.1-18.7 ("reparam", the default above). The
# check uses the largest, rounded up. Point masses (AutoDelta, AutoLaplaceApproximation) keep one
# joint precision over all their locs, with the same bound.
FULL_STEP_MATRICES = 19


class ScaleError(ValueError):
    """A data-parallel or memory setting that cannot work; the message says what and how to fix it."""


# ----------------------------------------------------------------------------- meshes and placement


def data_mesh(devices=None, axis_name: str = DATA_AXIS) -> Mesh:
    """A one-axis :class:`jax.sharding.Mesh` over ``devices`` (default: every device of every process)."""
    devices = jax.devices() if devices is None else list(devices)
    if not devices:
        raise ScaleError("data_mesh needs at least one device.")
    return Mesh(np.array(devices), (axis_name,))


def _mesh(mesh_or_devices, axis_name=None):
    if isinstance(mesh_or_devices, Mesh):
        if axis_name is not None and axis_name not in mesh_or_devices.axis_names:
            raise ScaleError(f"the mesh has axes {mesh_or_devices.axis_names}, not {axis_name!r}.")
        return mesh_or_devices, axis_name or mesh_or_devices.axis_names[0]
    return data_mesh(mesh_or_devices, axis_name or DATA_AXIS), axis_name or DATA_AXIS


def replicate(mesh_or_devices, tree):
    """``tree`` (parameters, an optimizer or SVI state) placed whole on every device of the mesh."""
    mesh, _ = _mesh(mesh_or_devices)
    sharding = NamedSharding(mesh, P())
    if jax.process_count() > 1:  # every process holds the same values: build the global array from them
        return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), tree)
    return jax.device_put(tree, sharding)


def _name(names, i):
    return repr(names[i]) if names is not None else f"argument {i}"


def shard_data(mesh_or_devices, *arrays, axis=0, axis_name=None, names: Sequence[str] | None = None, model=None,
               model_args=(), model_kwargs=None):
    r"""Place ``arrays`` on the mesh split along their plate dimension ``axis`` (the example axis).

    Returns the arrays (one array if one was given) with ``NamedSharding(mesh, P(..., "data", ...))``:
    each device holds ``n / k`` consecutive examples. Checked before anything runs: every array has
    the same length ``n`` along ``axis`` (the plate dimension; an array whose ``axis`` is another
    dimension is refused by name), and ``n`` is a multiple of the device count ``k``. With ``model``
    (and the other arguments the model takes, ``model_args``/``model_kwargs``), the placed arrays
    are also checked against the model's plates (:func:`check_data_sharding`).

    In a multi-process run (:func:`initialize`) each process passes its *own* rows; the global array
    has ``process_count`` times as many, in process order, and every process must hold as many rows.
    ``axis`` may be one int for all arrays or one per array; ``names`` labels them in errors.
    """
    mesh, axis_name = _mesh(mesh_or_devices, axis_name)
    if not arrays:
        raise ScaleError("shard_data needs at least one array.")
    if names is not None and len(names) != len(arrays):
        raise ScaleError(f"names has {len(names)} entries for {len(arrays)} arrays.")
    axes = list(axis) if isinstance(axis, (tuple, list)) else [axis] * len(arrays)
    if len(axes) != len(arrays):
        raise ScaleError(f"axis has {len(axes)} entries for {len(arrays)} arrays.")
    k = mesh.shape[axis_name]
    nproc = jax.process_count()
    local_k = k // nproc if nproc > 1 else k
    arrays = [np.asarray(a) if not isinstance(a, jax.Array) else a for a in arrays]
    lengths = []
    for i, (a, ax) in enumerate(zip(arrays, axes)):
        if not (-a.ndim <= ax < a.ndim):
            raise ScaleError(f"shard_data: {_name(names, i)} has shape {a.shape}, no axis {ax} to split.")
        axes[i] = ax % a.ndim
        lengths.append(a.shape[axes[i]])
    if len(set(lengths)) > 1:
        detail = ", ".join(f"{_name(names, i)} shape {a.shape} -> {n}" for i, (a, n) in enumerate(zip(arrays, lengths)))
        raise ScaleError(
            f"shard_data: the arrays differ in length along the plate axis ({detail}). Every array must be split "
            "along its example (plate) dimension: pass axis= per array (e.g. axis=(0, 0)) so that each names the "
            "dimension that indexes the data points, not a feature dimension."
        )
    n = lengths[0]
    per = local_k if nproc > 1 else k
    if n % per:
        where = f"this process's {n} rows over its {per} devices" if nproc > 1 else f"{n} examples over {k} devices"
        raise ScaleError(
            f"shard_data: the plate dimension of {_name(names, 0)} (shape {arrays[0].shape}, axis {axes[0]}) does not "
            f"divide evenly: {where}. Use a batch size that is a multiple of {per} (e.g. drop the last {n % per} "
            f"examples: {n - n % per}; or pad and mask them), or a mesh with a device count that divides {n}."
        )
    if nproc > 1:
        _check_process_rows(n)
    out = []
    for a, ax in zip(arrays, axes):
        spec = P(*([None] * ax + [axis_name]))
        sharding = NamedSharding(mesh, spec)
        if nproc > 1:
            out.append(jax.make_array_from_process_local_data(sharding, np.asarray(a)))
        else:
            out.append(jax.device_put(a, sharding))
    if model is not None:
        check_data_sharding(model, *model_args, *out, **(model_kwargs or {}))
    return out[0] if len(out) == 1 else tuple(out)


def _check_process_rows(n):
    """Every process must pass as many rows: a global array needs equal shards."""
    from jax.experimental import multihost_utils

    rows = np.asarray(multihost_utils.process_allgather(np.asarray([n], np.int64))).reshape(-1)
    if len(set(rows.tolist())) > 1:
        raise ScaleError(
            f"shard_data: the processes hold different numbers of rows {rows.tolist()} (process {jax.process_index()} "
            f"holds {n}). Split the data into {jax.process_count()} equal parts, one per process "
            "(nb.parallel.process_rows(n) gives each process its slice)."
        )


def process_rows(n: int) -> slice:
    """This process's contiguous slice of ``n`` examples in a multi-process run (all of them in one process);
    ``n`` must divide evenly by the process count."""
    nproc, pid = jax.process_count(), jax.process_index()
    if n % nproc:
        raise ScaleError(
            f"{n} examples do not split evenly over {nproc} processes: drop the last {n % nproc} or pad them."
        )
    per = n // nproc
    return slice(pid * per, (pid + 1) * per)


def check_data_sharding(model, *args, **kwargs):
    """Raise unless every sharded array argument of ``model`` is split along a plate dimension.

    ``model`` is traced once abstractly (``jax.eval_shape``; nothing is computed) to read its plates'
    sizes (full and subsample). An argument whose ``NamedSharding`` splits a dimension whose length
    is no plate's size (a feature dimension: ``P(None, "data")`` on an ``(N, D)`` design matrix) is
    reported by position with the fix. Call it with the arguments you give ``svi.run``.
    """
    from numpyro import handlers

    sizes = set()

    def run(key, *a, **kw):
        with handlers.trace() as tr, handlers.seed(rng_seed=key):
            model(*a, **kw)
        for site in tr.values():
            if site["type"] == "plate":
                full, sub = site["args"][0], site["args"][1]
                sizes.add(int(full))
                if sub is not None:
                    sizes.add(int(sub))
        return ()

    leaves, tree = jax.tree.flatten((args, kwargs))
    # eval_shape keeps the arrays abstract: the model's plates are static Python ints
    jax.eval_shape(lambda key, *ls: run(key, *jax.tree.unflatten(tree, ls)[0], **jax.tree.unflatten(tree, ls)[1]),
                   jax.random.PRNGKey(0), *leaves)
    named = [(f"argument {i} of the model", a) for i, a in enumerate(args)]
    for what, a in named + [(f"model argument {k!r}", a) for k, a in kwargs.items()]:
        for dim in _sharded_dims(a):
            if a.shape[dim] not in sizes:
                raise ScaleError(
                    f"{what} (shape {a.shape}) is sharded along dimension {dim} of length {a.shape[dim]}, which is "
                    f"not a plate of the model (plate sizes: {sorted(sizes) or 'none'}). Data-parallel SVI splits the "
                    "data along its plate (example) dimension: nb.shard_data(mesh, ..., axis=<the example axis>) "
                    "(for an (N, D) design matrix, axis=0)."
                )


def _sharded_dims(a):
    sharding = getattr(a, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return []
    return [d for d, entry in enumerate(sharding.spec) if entry is not None and d < np.ndim(a)]


# ----------------------------------------------------------------------------- per-device samples


def _check_axis(algorithm, axis_name, per_device_sample):
    own = getattr(algorithm.parts, "axis_name", None)
    if per_device_sample and own != axis_name:
        raise ScaleError(
            f"per_device_sample=True needs the algorithm built with axis_name={axis_name!r} (the mesh axis), "
            f"got axis_name={own!r}: e.g. nb.ivon(lr, ess=n, axis_name={axis_name!r})."
        )
    if not per_device_sample and own is not None:
        raise ScaleError(
            f"the algorithm was built with axis_name={own!r}, which only binds inside shard_map: use "
            "per_device_sample=True, or build it without axis_name for the shared-key mode."
        )


def _shard_mapped(fn, mesh, axis_name, batch_axis, nbatch):
    specs = tuple(P(*([None] * batch_axis + [axis_name])) for _ in range(nbatch))
    return jax.shard_map(fn, mesh=mesh, in_specs=(P(), P()) + specs, out_specs=P())


def data_parallel_step(algorithm, loss_fn, mesh, *, per_device_sample=False, batch_axis=0):
    r"""A jitted ``step(key, state, *batch) -> (state, info)`` of a deep-learning row over a data mesh.

    ``batch`` arrays are split along ``batch_axis`` (place them with :func:`shard_data`); the state
    stays replicated. ``loss_fn(params, *batch)`` is the *mean* loss of the batch.

    * ``per_device_sample=False`` (shared key): ``jax.jit`` of ``algorithm.step``; GSPMD splits the
      batch and inserts the reduction. The result equals the one-device step to rounding. Build the
      algorithm without ``axis_name``.
    * ``per_device_sample=True``: ``shard_map`` over the mesh's axis; the algorithm must be built with
      ``axis_name`` equal to that axis (``nb.ivon(..., axis_name="data")``): its ``step`` folds the
      device index into the key, so each device draws its own weights, and ``lax.pmean``-s the estimate
      (loss, gradient, curvature), as IVON's multi-GPU training does. The curvature's Monte Carlo
      variance falls by about the device count (``tests/parallel/test_scale.py`` measures it). Each device's
      loss is the mean over its shard, so the pmean is the mean over the batch.
    """
    mesh, axis_name = _mesh(mesh)
    _check_axis(algorithm, axis_name, per_device_sample)
    if not per_device_sample:
        return jax.jit(lambda key, state, *batch: algorithm.step(key, state, loss_fn, *batch))

    def step(key, state, *batch):
        local = lambda k, s, *b: algorithm.step(k, s, loss_fn, *b)  # noqa: E731
        return _shard_mapped(local, mesh, axis_name, batch_axis, len(batch))(key, state, *batch)

    return jax.jit(step)


def data_parallel_estimate(algorithm, loss_fn, mesh, *, per_device_sample=False, batch_axis=0):
    r"""The estimate alone (``Estimate(loss, grad, hessian)``, flat) that :func:`data_parallel_step` feeds
    the rule, as a jitted ``estimate(key, state, *batch)``: in the shared-key mode the row's estimator on
    the whole (sharded) batch, in the per-device-sample mode each device's estimator at its own draw
    (the device index folded into the key, as the row's ``step`` does) averaged by ``lax.pmean``.
    For measuring what the two modes give (the curvature's variance)."""
    mesh, axis_name = _mesh(mesh)
    _check_axis(algorithm, axis_name, per_device_sample)
    estimator = algorithm.parts.estimator
    if not per_device_sample:
        return jax.jit(lambda key, state, *batch: estimator(key, state, loss_fn, *batch))

    def local(key, state, *batch):
        key = jax.random.fold_in(key, jax.lax.axis_index(axis_name))
        return jax.lax.pmean(estimator(key, state, loss_fn, *batch), axis_name)

    return jax.jit(lambda key, state, *batch: _shard_mapped(local, mesh, axis_name, batch_axis, len(batch))(key, state, *batch))


def shard_state(mesh_or_devices, state, axis_name=None):
    r"""A diagonal row's state (``nb.ivon(...).init``, ``nb.as_optax(...).init``) with its flat vectors
    (mean, precision :math:`h + \delta`, momentum) split over the mesh, for networks whose optimizer
    state should not be replicated on every device (ZeRO-1 style: each device holds :math:`1/k`).

    Vectors whose length does not divide by the device count stay replicated. Under ``jit`` the
    elementwise update keeps the split (the tests check the output's sharding).
    """
    import warnings

    mesh, axis_name = _mesh(mesh_or_devices, axis_name)
    k = mesh.shape[axis_name]
    kept = []

    def place(x):
        if not isinstance(x, jax.Array):
            return x
        if x.ndim == 1 and x.shape[0] >= k and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            if x.shape[0] % k == 0:
                return jax.device_put(x, NamedSharding(mesh, P(axis_name)))
            kept.append(x.shape[0])
        return jax.device_put(x, NamedSharding(mesh, P()))

    out = jax.tree.map(place, state)
    if kept:
        warnings.warn(
            f"shard_state: vectors of length {sorted(set(kept))} do not split evenly over {k} devices (JAX shards "
            "only evenly) and stay replicated. The flat state has one entry per weight: a parameter count that is "
            f"a multiple of {k} splits.", RuntimeWarning, stacklevel=2)
    return out


def shardings_of(tree):
    """The sharding of every array of ``tree`` (for ``jax.jit(..., out_shardings=...)``: a step whose outputs
    keep the inputs' placement, e.g. parameters split along a layer's output axis)."""
    return jax.tree.map(lambda x: x.sharding, tree)


# ----------------------------------------------------------------------------- inspecting a step


COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def collective_counts(fn, *args, **kwargs):
    """How many of each cross-device collective the compiled ``jax.jit(fn)(*args, **kwargs)`` contains
    (XLA's optimised HLO: after GSPMD partitioning and the all-reduce combiner), with ``"where"``: the
    name of the operation each all-reduce reduces, from the HLO metadata. Asynchronous pairs
    (``all-reduce-start``/``-done``) count once."""
    import re

    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    text = jitted.lower(*args, **kwargs).compile().as_text()
    counts = {}
    for name in COLLECTIVES:
        counts[name] = len(re.findall(rf"\s{name}(?:-start)?\(", text))
    counts["where"] = re.findall(r"\sall-reduce(?:-start)?\(.*?op_name=\"([^\"]*)\"", text)
    return counts


# ----------------------------------------------------------------------------- memory


def available_memory(device) -> tuple[int, str]:
    """Bytes free on ``device`` and where the figure comes from: ``device.memory_stats()`` (GPU, TPU:
    ``bytes_limit - bytes_in_use``); on CPU, where it gives none, the host's available memory."""
    stats = None
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - a backend without memory statistics
        stats = None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)), f"{device} memory_stats()"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "host MemAvailable (/proc/meminfo)"
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "host available pages (sysconf)"
    except (ValueError, OSError, AttributeError):
        return -1, "unknown"


def _fmt(n):
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024


def guide_memory(params, layout, points=False):
    """``(D, bytes)``: the largest dense block of a guide's step and the bytes of ``FULL_STEP_MATRICES``
    matrices of ``D x D`` per full-covariance block (with ``points``, also one joint block over all point
    masses: nb.BLR's precision of AutoDelta/AutoLaplaceApproximation locs)."""
    from numpyro_blr.layout import FULL, POINT

    dims, need = [], 0
    point = 0
    itemsize = 4
    for b in layout.blocks:
        if b.kind == FULL:
            d = int(np.prod(np.shape(params[b.loc])))  # the raw scale_tril is a vector of D(D+1)/2 numbers
            itemsize = jnp.dtype(jnp.result_type(params[b.loc])).itemsize
            dims.append(d)
            need += FULL_STEP_MATRICES * d * d * itemsize
        elif b.kind == POINT and points:
            point += int(np.prod(np.shape(params[b.loc])))
            itemsize = jnp.dtype(jnp.result_type(params[b.loc])).itemsize
    if point:
        dims.append(point)
        need += FULL_STEP_MATRICES * point * point * itemsize
    return (max(dims) if dims else 0), need


def check_guide_memory(params, layout, device=None, points=False):
    """Raise :class:`ScaleError` before any step when a guide's dense blocks cannot fit on a device.

    Called by the optimizers' ``init``. ``D`` is each full-covariance block's dimension; the step holds
    about ``FULL_STEP_MATRICES`` ``D x D`` matrices (measured), replicated on every device of a data
    mesh. The message names ``D``, the bytes needed, the device's free memory and the alternatives
    (``AutoNormal``/``AutoDiagonalNormal``, or ``AutoLowRankMultivariateNormal`` with an optax or NumPyro
    optimizer: nb.BLR has no update for its low-rank covariance and rejects it).
    """
    d, need = guide_memory(params, layout, points)
    if not need:
        return
    if device is None:
        leaves = [x for x in jax.tree.leaves(params) if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)]
        devices = sorted(leaves[0].devices(), key=lambda dev: dev.id) if leaves else jax.local_devices()[:1]
        device = next((dv for dv in devices if dv.process_index == jax.process_index()), jax.local_devices()[0])
    free, source = available_memory(device)
    if free >= 0 and need > free:
        raise ScaleError(
            f"the guide's full-covariance block has D = {d}: one step holds about {FULL_STEP_MATRICES} D x D "
            f"matrices, {_fmt(need)} ({FULL_STEP_MATRICES} x {d}^2 x itemsize), on every device, but {device} has "
            f"{_fmt(free)} free ({source}). A full covariance fits up to D = "
            f"{int((free / (FULL_STEP_MATRICES * 4)) ** 0.5)} in float32 here. Use a diagonal guide (AutoNormal or "
            "AutoDiagonalNormal: nb.BLR or nb.IVON keep D numbers, and shard_state splits them), or "
            "AutoLowRankMultivariateNormal fitted with an optax or NumPyro optimizer (SVI(model, guide, "
            "optax.adam(1e-2), Trace_ELBO()): nb.BLR has no update for its low-rank covariance), or split the "
            "latents into several smaller blocks."
        )


# ----------------------------------------------------------------------------- several processes

ENV_COORDINATOR = "NUMPYRO_BLR_COORDINATOR"
ENV_NUM_PROCESSES = "NUMPYRO_BLR_NUM_PROCESSES"
ENV_PROCESS_ID = "NUMPYRO_BLR_PROCESS_ID"


def _int(value, name):
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ScaleError(f"{name} must be an integer, got {value!r}.") from None


def initialize(coordinator_address=None, num_processes=None, process_id=None, *, timeout=120):
    """``jax.distributed.initialize`` for a multi-process run, with the checks that fail fast.

    Arguments default to the environment variables that :func:`launch_local` sets
    (``NUMPYRO_BLR_COORDINATOR``, ``NUMPYRO_BLR_NUM_PROCESSES``, ``NUMPYRO_BLR_PROCESS_ID``). On CPU it selects
    JAX's gloo collectives (``jax_cpu_collectives_implementation``) first. Raises when ``process_id``
    is not in ``[0, num_processes)``, when JAX ends up with another process count than requested,
    or when the processes do not all meet within ``timeout`` seconds (the usual cause: processes
    started with different process counts or coordinator addresses). Call it before any other JAX call.
    """
    coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR)
    num_processes = _int(num_processes if num_processes is not None else os.environ.get(ENV_NUM_PROCESSES), "num_processes")
    process_id = _int(process_id if process_id is not None else os.environ.get(ENV_PROCESS_ID), "process_id")
    if not coordinator_address:
        raise ScaleError(f"initialize needs coordinator_address ('host:port') or ${ENV_COORDINATOR}.")
    if num_processes < 1 or not (0 <= process_id < num_processes):
        raise ScaleError(
            f"process_id={process_id} is not in [0, num_processes={num_processes}): every process gets the same "
            "num_processes and its own id from 0 to num_processes - 1."
        )
    if os.environ.get("JAX_PLATFORMS", "cpu").split(",")[0] in ("", "cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(coordinator_address, num_processes=num_processes, process_id=process_id,
                                   initialization_timeout=int(timeout))
    except Exception as err:  # noqa: BLE001 - JAX raises XlaRuntimeError or RuntimeError
        raise ScaleError(
            f"process {process_id} of {num_processes} could not join {coordinator_address} within {timeout} s ({err}). "
            "Start every process with the same num_processes and coordinator address, and process ids "
            f"0..{num_processes - 1} once each."
        ) from err
    if jax.process_count() != num_processes:
        raise ScaleError(
            f"asked for {num_processes} processes but JAX reports {jax.process_count()}: start every process "
            "with the same num_processes."
        )


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for the coordinator of a local run)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ProcessResult(NamedTuple):
    process_id: int
    returncode: int
    stdout: str
    stderr: str


def launch_local(argv, num_processes=2, *, timeout=300, env=None, cwd=None) -> list:
    """Run ``python *argv`` as ``num_processes`` local processes of one JAX job and wait for all of them.

    Each gets ``NUMPYRO_BLR_COORDINATOR=127.0.0.1:<free port>``, ``NUMPYRO_BLR_NUM_PROCESSES`` and its
    ``NUMPYRO_BLR_PROCESS_ID`` (the script calls :func:`initialize`). Returns one
    :class:`ProcessResult` per process. If one fails or the run exceeds ``timeout`` seconds, the others
    are killed and :class:`RuntimeError` reports each process's exit code and the end of its stderr.
    Command line: ``python -m numpyro_blr.parallel --processes 2 script.py [args]``.
    """
    num_processes = _int(num_processes, "num_processes")
    if num_processes < 1:
        raise ScaleError(f"num_processes must be >= 1, got {num_processes}.")
    import tempfile

    port = free_port()
    procs, files = [], []
    base = dict(os.environ if env is None else env)
    try:
        for pid in range(num_processes):
            e = dict(base, **{ENV_COORDINATOR: f"127.0.0.1:{port}", ENV_NUM_PROCESSES: str(num_processes),
                              ENV_PROCESS_ID: str(pid)})
            # output to files, not pipes: a process that writes more than a pipe holds would block
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            files.append((out, err))
            procs.append(subprocess.Popen([sys.executable, *argv], env=e, cwd=cwd, stdout=out, stderr=err, text=True))
        deadline = time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in procs]  # every process polled (no short-circuit)
            if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
                break
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        timed_out = any(c is None for c in codes) and all(c in (None, 0) for c in codes)
        for p in procs:  # the others, once one failed or the time is up
            if p.poll() is None:
                p.kill()
            p.wait()
        results = []
        for i, (p, (out, err)) in enumerate(zip(procs, files)):
            out.seek(0)
            err.seek(0)
            results.append(ProcessResult(i, p.returncode, out.read(), err.read()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for out, err in files:
            out.close()
            err.close()
    if timed_out or any(r.returncode != 0 for r in results):
        what = f"did not finish within {timeout} s" if timed_out else "failed"
        tails = "\n".join(f"--- process {r.process_id} (exit {r.returncode}):\n{r.stderr[-2000:]}" for r in results)
        raise RuntimeError(f"the {num_processes}-process run {what}:\n{tails}")
    return results


def _main(argv=None):
    import argparse

    parser = argparse.ArgumentParser(prog="python -m numpyro_blr.parallel",
                                     description="Run a script as N local processes of one JAX job (127.0.0.1).")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("script", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    if not ns.script:
        parser.error("give the script to run (and its arguments)")
    for r in launch_local(ns.script, ns.processes, timeout=ns.timeout):
        sys.stdout.write(r.stdout)
        sys.stderr.write(r.stderr)


if __name__ == "__main__":
    _main()

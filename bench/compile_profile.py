"""Where a compiled SVI fit's code comes from: XLA's CPU object code of the step, by source line.

On XLA's CPU backend compiling a program is mostly generating machine code, one LLVM module per
fused kernel (lowering takes 0.1-0.7 s of it), and its time follows the size of the code: on the
breast-cancer model, one core, a 100-step scan of Adam compiles 114-164 KB of objects in 0.85-1.35 s
(``AutoNormal``, ``AutoMultivariateNormal``) and one of ``nb.BLR()`` 308-346 KB in 2.7-3.1 s, about
0.08-0.09 s per 10 KB either way. Object sizes do not vary between runs, compile seconds do (by
+-10% on one core of a quiet machine), so this is the measure to compare two versions of a step
with, and to find what to make smaller:

* per optimizer, in one process: kernels, object KB, compile CPU seconds, and the object code split
  between ``numpyro_blr``'s own source lines, NumPyro's (model, guide, ELBO, distributions: every
  kernel whose innermost Python frame is in NumPyro, wherever it is called from) and kernels XLA
  made without a source line (copies, dots, loop bodies);
* for ``nb.BLR``: its largest kernels, and its object code by ``numpyro_blr`` source line.

Two things this found, as a guide for the next ones: XLA fuses a transcendental function into a
``concatenate`` as a 31 KB kernel where the two apart are 6 KB (``layout.GatherScaledUnitLowerCholesky``
materialises its diagonal first), and differentiating a transform inside a JVP compiles its
tangent with the loss (``GaussianBlock.scaling_tangent``).

Run: python bench/compile_profile.py [--case NAME] [--guide MVN|MF] [--steps N] [--blr "hessian='reparam'"]
                                     [--top K] [--float32] [--keep]
"""

import argparse
import collections
import glob
import os
import re
import resource
import shutil
import sys
import tempfile

FLOAT32 = "--float32" in sys.argv
DUMP = tempfile.mkdtemp(prefix="xla_dump_")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={DUMP}").strip()

import numpyro  # noqa: E402

if not FLOAT32:
    numpyro.enable_x64()

import jax  # noqa: E402
from numpyro.infer import SVI, Trace_ELBO  # noqa: E402
from numpyro.infer.autoguide import AutoMultivariateNormal, AutoNormal  # noqa: E402

import numpyro_blr as nb  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import robustness_cases as rc  # noqa: E402

GUIDES = {"MVN": AutoMultivariateNormal, "MF": AutoNormal}
OURS, NUMPYRO, OTHER = "numpyro_blr", "NumPyro", "no source line"


def cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def compile_fit(case, guide_cls, optim, steps, name):
    """Compile ``svi.update`` scanned ``steps`` times as the jitted function ``name``; its CPU seconds."""
    svi = SVI(case.model, guide_cls(case.model), optim, Trace_ELBO())
    state = svi.init(jax.random.PRNGKey(0), *case.args, **case.kwargs)

    def body(state):
        def one(s, _):
            return svi.update(s, *case.args, **case.kwargs)

        return jax.lax.scan(one, state, None, length=steps)

    body.__name__ = body.__qualname__ = name
    lowered = jax.jit(body).lower(state)
    c0 = cpu_seconds()
    lowered.compile()
    return cpu_seconds() - c0


def _table(text, name):
    match = re.search(name + r"\n(.*?)\n\n", text, re.S)
    return match.group(1).splitlines() if match else []


class SourceMap:
    """The stack frames of an optimised HLO dump: instruction name -> (op name, innermost frames)."""

    def __init__(self, text):
        files = {int(l.split()[0]): l.split(None, 1)[1].strip('"') for l in _table(text, "FileNames")}
        funcs = {int(l.split()[0]): l.split(None, 1)[1].strip('"') for l in _table(text, "FunctionNames")}
        self.locations, self.frames = {}, {}
        for line in _table(text, "FileLocations"):
            m = re.match(r"(\d+) \{file_name_id=(\d+) function_name_id=(\d+) line=(\d+)", line)
            if m:
                self.locations[int(m[1])] = (files[int(m[2])], funcs[int(m[3])], int(m[4]))
        for line in _table(text, "StackFrames"):
            m = re.match(r"(\d+) \{file_location_id=(\d+) parent_frame_id=(\d+)", line)
            if m:
                self.frames[int(m[1])] = (int(m[2]), int(m[3]))
        self.instructions = {}
        for line in text.splitlines():
            m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = .*?op_name=\"([^\"]*)\".*?stack_frame_id=(\d+)", line)
            if m:
                self.instructions[m[1]] = (m[2], int(m[3]))

    def chain(self, frame):
        """``(file, function, line)`` from the innermost frame out."""
        out, seen = [], set()
        while frame in self.frames and frame not in seen:
            seen.add(frame)
            location, parent = self.frames[frame]
            out.append(self.locations[location])
            frame = parent
        return out

    def source(self, kernel):
        """``(group, where, op)`` of a kernel: the innermost frame in numpyro_blr or in NumPyro."""
        op, frame = self.instructions.get(kernel, ("", None))
        for path, func, line in self.chain(frame) if frame is not None else []:
            if "/numpyro_blr/" in path:
                return OURS, f"numpyro_blr/{path.split('/numpyro_blr/')[-1]}:{line} {func}", op
            if "/numpyro/" in path:
                return NUMPYRO, f"numpyro/{path.split('/numpyro/')[-1]}:{line} {func}", op
        return OTHER, "", op


def kernels_of(name):
    """``[(bytes, kernel, group, where, op)]`` of the last compiled module of the function ``name``."""
    hlos = sorted(glob.glob(os.path.join(DUMP, f"module_*.jit_{name}.cpu_after_optimizations.txt")))
    if not hlos:
        raise RuntimeError(f"no XLA dump of jit_{name} in {DUMP}: this jax does not dump CPU modules there")
    module = os.path.basename(hlos[-1]).split(".")[0]
    with open(hlos[-1]) as f:
        sources = SourceMap(f.read())
    out = []
    for path in glob.glob(os.path.join(DUMP, f"{module}.jit_{name}.obj-file.*")):
        kernel = os.path.basename(path).split("obj-file.", 1)[1]
        kernel = re.sub(r"(_kernel_module)?\.o$", "", re.sub(r"^__compute_module_", "", kernel))
        out.append((os.path.getsize(path), kernel, *sources.source(kernel)))
    return sorted(out, reverse=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", default="breast_cancer_standardised")
    p.add_argument("--guide", default="MVN", choices=sorted(GUIDES))
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--blr", default="", help="keyword arguments of nb.BLR, as Python source")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--float32", action="store_true")
    p.add_argument("--keep", action="store_true", help="keep XLA's dump (its folder is printed)")
    args = p.parse_args(argv)
    case, guide_cls = rc.get(args.case), GUIDES[args.guide]
    blr_kwargs = eval(f"dict({args.blr})")  # noqa: S307 - a bench's command line
    # NumPyro's eager set-up of the case (the autoguide runs the model, op by op) before anything is timed
    SVI(case.model, guide_cls(case.model), numpyro.optim.Adam(0.01), Trace_ELBO()).init(
        jax.random.PRNGKey(0), *case.args, **case.kwargs)
    optims = {f"nb.BLR({args.blr})": ("fit_blr", nb.BLR(**blr_kwargs)), "Adam(0.01)": ("fit_adam", numpyro.optim.Adam(0.01))}
    rows = {}
    for label, (name, optim) in optims.items():
        seconds = compile_fit(case, guide_cls, optim, args.steps, name)
        rows[label] = (seconds, kernels_of(name))
    print(f"{args.case}, {guide_cls.__name__} (d={rc.n_params(case)}), {args.steps}-step scan, "
          f"{'float32' if FLOAT32 else 'float64'}, jax {jax.__version__}")
    print(f"{'':22s} {'kernels':>7s} {'object KB':>9s} {'compile CPU s':>13s} | "
          + " | ".join(f"{g} KB" for g in (OURS, NUMPYRO, OTHER)))
    for label, (seconds, kernels) in rows.items():
        by_group = collections.Counter()
        for size, _, group, _, _ in kernels:
            by_group[group] += size
        total = sum(by_group.values())
        print(f"{label:22s} {len(kernels):7d} {total / 1024:9.0f} {seconds:13.2f} | "
              + " | ".join(f"{by_group[g] / 1024:{len(g) + 3}.0f}" for g in (OURS, NUMPYRO, OTHER)))
    (s_blr, k_blr), (s_adam, k_adam) = rows.values()
    size = lambda ks: sum(k[0] for k in ks)  # noqa: E731
    print(f"BLR / Adam: object code {size(k_blr) / size(k_adam):.2f}x, compile CPU time {s_blr / s_adam:.2f}x")
    blr_label = next(iter(rows))
    print(f"\nlargest kernels of {blr_label}:")
    for size_, kernel, group, where, op in k_blr[: args.top]:
        print(f"  {size_ / 1024:5.1f} KB  {kernel[:36]:36s} {where or op[-50:]}")
    lines = collections.Counter()
    counts = collections.Counter()
    for size_, _, group, where, _ in k_blr:
        if group == OURS:
            lines[where] += size_
            counts[where] += 1
    print(f"\n{blr_label}'s own code by source line ({sum(lines.values()) / 1024:.0f} KB):")
    for where, size_ in lines.most_common(args.top):
        print(f"  {size_ / 1024:5.1f} KB  {counts[where]:3d} kernels  {where}")
    if args.keep:
        print(f"\nXLA dump kept in {DUMP}")
    else:
        shutil.rmtree(DUMP, ignore_errors=True)


if __name__ == "__main__":
    main()

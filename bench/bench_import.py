"""Import time of ``numpyro_blr`` against ``numpyro`` (issue 11: within 0.5 s of ``import numpyro``).

Each import runs in a fresh interpreter (nothing cached in ``sys.modules``); the best of ``--repeat``
runs is printed, with the difference and whether the heavy diagnostics stack was loaded.
Run: ``python bench/bench_import.py [--repeat 3]``.
"""

import argparse
import json
import subprocess
import sys

PROBE = (
    "import sys, time; t = time.perf_counter(); import {module}; dt = time.perf_counter() - t; "
    "import json; print(json.dumps({{'seconds': dt, 'heavy': sorted(m for m in ('arviz', 'arviz_base', 'xarray', "
    "'scipy', 'matplotlib') if m in sys.modules)}}))"
)


def import_time(module, repeat):
    best, heavy = float("inf"), None
    for _ in range(repeat):
        out = subprocess.run([sys.executable, "-c", PROBE.format(module=module)], capture_output=True, text=True, check=True)
        result = json.loads(out.stdout.strip().splitlines()[-1])
        if result["seconds"] < best:
            best, heavy = result["seconds"], result["heavy"]
    return best, heavy


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    base, base_heavy = import_time("numpyro", args.repeat)
    ours, ours_heavy = import_time("numpyro_blr", args.repeat)
    print(f"import numpyro     : {base:.2f} s (best of {args.repeat}; heavy modules loaded: {base_heavy or 'none'})")
    print(f"import numpyro_blr : {ours:.2f} s (best of {args.repeat}; heavy modules loaded: {ours_heavy or 'none'})")
    print(f"difference         : {ours - base:+.2f} s (target: within +0.50 s)")


if __name__ == "__main__":
    main()

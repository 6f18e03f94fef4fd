"""First contact: ``import numpyro_blr`` stays light (issue 11, item 7)."""

import json
import os
import subprocess
import sys

import pytest

HEAVY = ("arviz", "arviz_base", "xarray", "matplotlib")


def _modules_after(code):
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run(
        [sys.executable, "-c", code + f"; import sys, json; print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"],
        capture_output=True, text=True, check=True, env=env,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_does_not_load_the_diagnostics_stack():
    assert _modules_after("import numpyro_blr as nb; nb.BLR(); nb.ExpFamilyGuide") == []


@pytest.mark.slow
def test_diagnostics_load_on_first_use():
    assert "arviz_base" in _modules_after("import numpyro_blr as nb; nb.diagnostics.check_fit")
    assert "xarray" in _modules_after("from numpyro_blr.diagnostics import to_datatree")

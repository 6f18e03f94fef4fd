"""`make demo` writes a figure (issue 11, item 10): the plotting function on small synthetic inputs."""

import importlib.util
import pathlib

import numpy as np

from numpyro_blr.monitor import ELBOCurve

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _demo_module():
    spec = importlib.util.spec_from_file_location("demo_logistic_regression", ROOT / "examples" / "logistic_regression.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_demo_figure_is_written(tmp_path):
    demo = _demo_module()
    curves = {
        "BLR": ELBOCurve(np.array([0, 1, 2, 5, 10]), np.array([-300.0, -80.0, -75.0, -74.6, -74.5]), {}, None),
        "Adam(0.01)": ELBOCurve(np.array([0, 50, 100, 500]), np.array([-300.0, -150.0, -90.0, -74.7]), {}, None),
    }
    lower = np.array([-1.0, 0.0, 0.5])
    intervals = {"NUTS": (lower, lower + 1), "BLR": (lower + 0.01, lower + 1.02), "Adam(0.01)": (lower + 0.1, lower + 0.9)}
    path = tmp_path / "figures" / "demo.png"
    out = demo.demo_figure(curves, {"BLR": 0.2, "Adam(0.01)": 0.05}, intervals, str(path))
    assert out == str(path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000

"""Packaging metadata that a fresh clone builds with (issue 11, item 8)."""

import pathlib
import re
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_build_requires_a_setuptools_that_reads_the_spdx_license():
    requires = _pyproject()["build-system"]["requires"]
    (setuptools,) = [r for r in requires if r.startswith("setuptools")]
    lower = re.match(r"setuptools>=(\d+)", setuptools)
    assert lower and int(lower.group(1)) >= 77  # setuptools < 77 rejects license = "Apache-2.0"


def test_license_file_matches_the_declared_license():
    project = _pyproject()["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text


def test_changelog_authors_and_urls():
    project = _pyproject()["project"]
    assert project["authors"] and project["urls"]
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert f"## {project['version']}" in changelog

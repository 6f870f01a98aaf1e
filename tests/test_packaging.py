"""What a package index shows and what the sdist carries."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_readme_links_work_on_a_package_index_page():
    # A package index renders README.md without the repository: relative links break there.
    text = (REPO / "README.md").read_text()
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    assert targets
    assert [t for t in targets if not t.startswith(("https://", "#"))] == []


def test_license_is_declared_and_shipped():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == "BSD-3-Clause" and project["license-files"] == ["LICENSE"]
    assert (REPO / "LICENSE").read_text().startswith("BSD 3-Clause License")
    assert project["urls"]["Source"].startswith("https://")
    assert any(c.startswith("Environment :: GPU :: NVIDIA CUDA") for c in project["classifiers"])


def test_sdist_carries_the_tests_with_their_conftest():
    manifest = (REPO / "MANIFEST.in").read_text().split()
    assert "tests" in manifest and "kernelbench" in manifest

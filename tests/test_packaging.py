"""The package builds and its artefacts are what a user should get: an sdist and a wheel built
from a copy of the repository (the files git would check out: tracked plus untracked, not the
ignored ones) pass ``twine check``, the wheel ships the package, its ``py.typed`` marker and the
LICENSE, and neither the tests nor the docs tooling; the sdist ships the release files
(CHANGELOG.md, CITATION.cff, LICENSE) and the whole test suite (``MANIFEST.in``).

The build runs with ``--no-isolation`` (no network: it uses this environment's setuptools, which
the ``test`` extra pins to >=77, the first to read the SPDX ``license = "Apache-2.0"`` string).
Skipped when ``build``/``twine`` are missing or the tree is not a git checkout.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("build")
pytest.importorskip("twine")

ROOT = Path(__file__).resolve().parents[1]


def _checkout_files() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    return [f for f in out.split("\0") if f and (ROOT / f).is_file()]


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> dict[str, Path]:
    src = tmp_path_factory.mktemp("checkout")
    for name in _checkout_files():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"python -m build failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    wheels, sdists = sorted(out.glob("*.whl")), sorted(out.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, sorted(p.name for p in out.iterdir())
    return {"wheel": wheels[0], "sdist": sdists[0]}


def test_twine_check(dists):
    proc = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", str(dists["wheel"]), str(dists["sdist"])],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_wheel_contents(dists):
    import chunkop

    names = zipfile.ZipFile(dists["wheel"]).namelist()
    assert "chunkop/__init__.py" in names
    assert "chunkop/py.typed" in names, "the PEP 561 marker is not shipped (package-data)"
    assert any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE") for n in names), names
    # every module of the installed package is in the wheel
    modules = {f"chunkop/{p.name}" for p in Path(chunkop.__file__).parent.glob("*.py")}
    assert modules <= set(names), sorted(modules - set(names))
    for name in names:
        top = name.split("/")[0]
        assert top == "chunkop" or top.endswith(".dist-info"), f"unexpected file in the wheel: {name}"
        assert not name.startswith(("tests/", "docs/", "docs_hooks/")), name
        assert "griffe_roles" not in name, name


def test_wheel_metadata(dists):
    import chunkop

    wheel = zipfile.ZipFile(dists["wheel"])
    meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    text = wheel.read(meta).decode()
    assert f"Version: {chunkop.__version__}\n" in text
    assert "License-Expression: Apache-2.0" in text or "License: Apache-2.0" in text
    assert "Description-Content-Type: text/markdown" in text


def test_sdist_contents(dists):
    with tarfile.open(dists["sdist"]) as sdist:
        names = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
    for required in ("LICENSE", "README.md", "pyproject.toml", "src/chunkop/__init__.py", "src/chunkop/py.typed"):
        assert required in names, f"{required} missing from the sdist"
    # MANIFEST.in: the release files, and the whole test suite (not only tests/test_*.py)
    for required in ("CHANGELOG.md", "CITATION.cff", "tests/conftest.py", "tests/operator_registry.py"):
        assert required in names, f"{required} missing from the sdist (MANIFEST.in)"
    tests = {n for n in names if n.startswith("tests/") and n.endswith(".py")}
    checkout = {f for f in _checkout_files() if f.startswith("tests/") and f.endswith(".py")}
    assert checkout <= tests, f"test files missing from the sdist: {sorted(checkout - tests)}"
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in names), "bytecode in the sdist"
    assert "docs_hooks/griffe_roles.py" not in names and "docs/griffe_roles.py" not in names


def test_build_requirements():
    """setuptools < 77 cannot read the SPDX ``license = "Apache-2.0"`` string: the build must ask
    for 77 or later (in isolated builds, which pip and ``python -m build`` do by default)."""
    text = (ROOT / "pyproject.toml").read_text()
    requires = re.search(r"^\[build-system\]\n(?:#.*\n)*requires = \[([^\]]*)\]", text, re.MULTILINE)
    assert requires, "no [build-system] requires"
    setuptools = re.search(r'"setuptools>=(\d+)', requires.group(1))
    assert setuptools and int(setuptools.group(1)) >= 77, requires.group(1)
    assert re.search(r'^license = "Apache-2\.0"$', text, re.MULTILINE)


def test_release_files_agree():
    """pyproject's version, chunkop.__version__, CITATION.cff and the CHANGELOG name one release."""
    import chunkop

    version = re.search(r'^version = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), re.MULTILINE).group(1)
    assert chunkop.__version__ == version
    citation = (ROOT / "CITATION.cff").read_text()
    assert re.search(rf"^version: {re.escape(version)}$", citation, re.MULTILINE), "CITATION.cff version"
    assert re.search(r"^cff-version: 1\.2\.0$", citation, re.MULTILINE)
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in changelog
    released = re.search(rf"^## \[{re.escape(version)}\] - (\d{{4}}-\d{{2}}-\d{{2}})$", changelog, re.MULTILINE)
    assert released, f"CHANGELOG.md has no '## [{version}] - YYYY-MM-DD' section"
    assert re.search(rf'^date-released: "{released.group(1)}"$', citation, re.MULTILINE), "release dates differ"
    assert "Apache License" in (ROOT / "LICENSE").read_text() and "Version 2.0" in (ROOT / "LICENSE").read_text()


def test_auto_workers_bounded_by_cores_and_memory(monkeypatch):
    """The README's ``-n auto`` starts one worker per usable core, no more than memory holds."""
    import conftest

    monkeypatch.setattr(conftest, "_usable_cpus", lambda: 64)
    monkeypatch.setattr(conftest, "_available_bytes", lambda: 20 << 30)
    assert conftest.pytest_xdist_auto_num_workers(None) == 20 // 3
    monkeypatch.setattr(conftest, "_available_bytes", lambda: 1 << 30)
    assert conftest.pytest_xdist_auto_num_workers(None) == 1
    monkeypatch.setattr(conftest, "_available_bytes", lambda: None)
    assert conftest.pytest_xdist_auto_num_workers(None) == 64
    monkeypatch.undo()
    assert 1 <= conftest.pytest_xdist_auto_num_workers(None) <= (os.cpu_count() or 1)

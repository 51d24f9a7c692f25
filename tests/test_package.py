"""The Python side is one package, `microgpt` (pyproject.toml): every module has one import name,
nothing edits sys.path, and the entry points run as the README shows them."""
import subprocess
import sys

import pytest

from engine_util import REPO, python_env

PYTHON_DIRS = ("microgpt", "scripts", "tests", "bench")


def python_files():
    return sorted(p for d in PYTHON_DIRS for p in (REPO / d).rglob("*.py"))


def test_no_module_edits_sys_path():
    offenders = [str(p.relative_to(REPO)) for p in python_files() if "sys.path" in p.read_text()
                 and p.name != "test_package.py"]
    assert not offenders, f"sys.path edited in {offenders}: import from the microgpt package instead"


def test_package_modules_are_imported_by_their_package_name():
    """`import atomic` beside `import microgpt.atomic` would load the module twice, with two states."""
    modules = {p.stem for p in (REPO / "microgpt").glob("*.py")} - {"__init__"}
    bare = [f"{p.relative_to(REPO)}: {line.strip()}" for p in python_files()
            for line in p.read_text().splitlines()
            if line.strip().startswith(("import ", "from ")) and line.split()[1].split(".")[0] in modules]
    assert not bare, bare


@pytest.mark.parametrize("entry", ["microgpt/training_proxy.py",
                                   "scripts/prepare-data.py", "scripts/fetch-assets.py",
                                   "scripts/pull-hermes3.py", "scripts/prep-megachat.py"])
def test_entry_points_run_as_scripts(entry):
    res = subprocess.run([sys.executable, str(REPO / entry), "--help"], capture_output=True, text=True,
                         timeout=60, env=python_env(), cwd=REPO.parent)
    assert res.returncode == 0 and "usage" in res.stdout.lower(), res.stderr[-2000:]

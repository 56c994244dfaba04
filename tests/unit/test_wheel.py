"""The wheel installs one top-level name, `kvhandoff` (issue 34): an engine's environment that
installs kvhandoff gains no generic `service`, `pipelines` or `transport` module for a user's own
`service.py` to shadow or a PyPI project of that name to clash with.

Built from this checkout with pip (no index, no build isolation: the test environment's
setuptools), then installed into a scratch folder and imported from there.
"""

from __future__ import annotations

import configparser
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("service", "pipelines", "transport")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            *(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-index"),
            *("--no-build-isolation", "--wheel-dir", str(out), str(ROOT)),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    (path,) = out.glob("kvhandoff-*.whl")
    return path


def test_the_wheel_holds_only_kvhandoff_and_its_dist_info(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    (dist_info,) = tops - {"kvhandoff"}
    assert dist_info.startswith("kvhandoff-") and dist_info.endswith(".dist-info"), tops
    # A namespace: no `kvhandoff/__init__.py` of its own, only the three mapped folders.
    assert {name.split("/")[1] for name in names if name.startswith("kvhandoff/")} == set(FOLDERS)


def test_every_source_module_is_in_the_wheel_under_kvhandoff(wheel: Path) -> None:
    # Sub-packages are found by setup.py, not listed: one left out would import from a checkout
    # and fail where kvhandoff is installed.
    shipped = {n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("kvhandoff/")}
    sources = {
        f"kvhandoff/{path.relative_to(ROOT).as_posix()}"
        for folder in FOLDERS
        for path in (ROOT / folder).rglob("*")
        if path.suffix == ".py" or path.name == "py.typed"
    }
    assert sources - shipped == set()
    assert "kvhandoff/service/api/dashboard.html" in shipped
    assert {n for n in shipped if not n.endswith((".py", "py.typed"))} == {
        "kvhandoff/service/api/dashboard.html"
    }


def test_every_entry_point_names_a_module_in_the_wheel(wheel: Path) -> None:
    archive = zipfile.ZipFile(wheel)
    (entry_points,) = [n for n in archive.namelist() if n.endswith(".dist-info/entry_points.txt")]
    parser = configparser.ConfigParser()
    parser.read_string(archive.read(entry_points).decode())
    groups = {"console_scripts", "sglang.srt.plugins", "vllm.general_plugins"}
    assert groups <= set(parser.sections())
    shipped = set(archive.namelist())
    for group in groups:
        for name, target in parser.items(group):
            module = target.split(":")[0]
            assert module.startswith("kvhandoff."), (group, name, target)
            assert f"{module.replace('.', '/')}.py" in shipped, (group, name, target)


def test_the_installed_wheel_imports_from_outside_the_checkout(wheel: Path, tmp_path: Path) -> None:
    # Installed into a scratch folder with this environment's dependencies; run from outside
    # the checkout, where only the installed names exist.
    site = tmp_path / "site"
    subprocess.run(
        [
            *(sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index"),
            *("--target", str(site), str(wheel)),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    # `bin/` holds the console script, not a module.
    installed = {p.name for p in site.iterdir() if not p.name.endswith(".dist-info")}
    assert installed == {"kvhandoff", "bin"}
    code = (
        "import importlib.util, kvhandoff.service.cli as cli\n"
        "print(cli.__file__)\n"
        "print([n for n in ('service', 'pipelines', 'transport') if importlib.util.find_spec(n)])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    where, bare = out.stdout.splitlines()
    assert Path(where).is_relative_to(site), where
    assert bare == "[]"
    help_out = subprocess.run(
        [str(site / "bin" / "kvhandoff"), "--help"],
        cwd=tmp_path,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert help_out.returncode == 0, help_out.stderr
    assert "usage: kvhandoff" in help_out.stdout

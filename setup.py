"""The package map, which pyproject.toml cannot state: the source folders stay at the top of the
repository (service/, pipelines/, transport/), and everything installs under one `kvhandoff`
name (`kvhandoff.service`, ...), so an engine's environment gains no generic top-level module.

Sub-packages are found, not listed, so a new one cannot be left out of the wheel
(tests/unit/test_wheel.py checks the built wheel against the folders). `kvhandoff` itself is a
namespace package: it has no folder of its own.
"""

from setuptools import find_packages, setup

FOLDERS = ("service", "pipelines", "transport")
PACKAGES = find_packages(include=[f"{folder}{tail}" for folder in FOLDERS for tail in ("", ".*")])

setup(
    packages=[f"kvhandoff.{package}" for package in PACKAGES],
    package_dir={f"kvhandoff.{folder}": folder for folder in FOLDERS},
)

"""Maps the repository's top-level folders under the one import name `pdserve`.

The metadata lives in pyproject.toml. setuptools' `packages.find` there cannot put a prefix
before the names it finds, so the package list is made here: `engine/model` installs as
`pdserve.engine.model`. tests/cli/test_installed.py checks the wheel.
"""
from setuptools import find_packages, setup

# The folders installed as pdserve's subpackages; tests/ and bench/ run from the checkout.
SUBPACKAGES = ("engine", "kernels", "services", "cli", "sim", "profiler", "autoscale")

package_dir = {"pdserve": "pdserve"}
packages = ["pdserve"]
for top in SUBPACKAGES:
    package_dir[f"pdserve.{top}"] = top
    packages += [f"pdserve.{name}" for name in find_packages(include=[top, f"{top}.*"])]

setup(packages=packages, package_dir=package_dir)

"""The product as users get it: the wheel `pip wheel .` builds, installed into a fresh
virtual environment outside the checkout, its `pdserve` run from a directory that is not
the checkout (so the repository on sys.path cannot hide a missing package or file).

The new environment gets the wheel itself (`--no-deps --no-index`); its dependencies come
from the test environment's site-packages through a plain path line in a .pth file, added
after the install so pip never sees the checkout's editable pdserve. A plain path line (not
`site.addsitedir`) keeps the .pth files in that folder, the editable install's among them,
unprocessed: only the wheel's pdserve can be imported.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Installed:
    wheel: Path
    prefix: Path           # the virtual environment
    workdir: Path          # an empty directory outside the checkout, the commands' cwd

    @property
    def pdserve(self) -> str:
        return str(self.prefix / "bin" / "pdserve")

    @property
    def python(self) -> str:
        return str(self.prefix / "bin" / "python")

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a command run as a user runs it: no PYTHONPATH into the checkout."""
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
        return dict(env, PATH=f"{self.prefix / 'bin'}{os.pathsep}{env.get('PATH', '')}", **extra)

    def run(self, *args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run([self.pdserve, *args], cwd=self.workdir, env=self.env(**env),
                              capture_output=True, text=True, timeout=timeout)

    def run_python(self, code: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """`python -c code` in the environment, from outside the checkout."""
        return subprocess.run([self.python, "-c", code], cwd=self.workdir, env=self.env(),
                              capture_output=True, text=True, timeout=timeout)


def build_wheel(out_dir: Path) -> Path:
    """`pip wheel .` of a clean copy of the checkout, as of a fresh clone with the working
    tree's changes (setuptools reuses a stale build/lib in place, which once hid a package
    dropped from pyproject.toml); no build isolation: setuptools comes from the test environment."""
    source = out_dir / "source"
    for name in repository_files():
        target = source / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, target, follow_symlinks=False)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(out_dir), str(source)], check=True, timeout=300)
    (wheel,) = out_dir.glob("pdserve-*.whl")
    return wheel


def repository_files(*paths: str) -> list[str]:
    """The files git tracks, or would (not ignored), under `paths` (all by default)."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *paths],
                         cwd=REPO, check=True, capture_output=True, text=True).stdout.split("\n")
    return [name for name in out if name and os.path.lexists(REPO / name)]


def install(wheel: Path, prefix: Path, workdir: Path) -> Installed:
    workdir.mkdir(exist_ok=True)
    venv.EnvBuilder(with_pip=True, symlinks=True).create(prefix)
    subprocess.run([str(prefix / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                    str(wheel)], check=True, timeout=300, cwd=workdir)
    site = Path(subprocess.run([str(prefix / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "zz_test_dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return Installed(wheel, prefix, workdir)


def wheel_files(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as z:
        return {name for name in z.namelist() if ".dist-info/" not in name}

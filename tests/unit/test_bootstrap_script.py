"""``scripts/bootstrap.sh``: the virtualenv it sets up is the checkout's, wherever it is run from.

The script runs in a copy of the checkout's files it reads, with stand-ins for the interpreter and
for dpkg-query, so nothing is installed and the real virtualenv is never touched.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Answers what bootstrap.sh asks an interpreter; ``-m venv DIR`` makes DIR/bin/python (itself).
FAKE_PYTHON = """#!/usr/bin/env bash
if [ "${1:-}" = -m ] && [ "${2:-}" = venv ]; then
  mkdir -p "$3/bin" && cp "$0" "$3/bin/python"
elif [ "${1:-}" = -c ] && [[ "${2:-}" == *version_info* ]]; then
  echo 3.11
fi
exit 0
"""
# Every Debian package is installed.
FAKE_DPKG_QUERY = """#!/usr/bin/env bash
printf 'ii '
"""


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A copy of what bootstrap.sh reads from the checkout: itself, the lock file and pyproject.toml."""
    copy = tmp_path / "checkout"
    (copy / "scripts").mkdir(parents=True)
    shutil.copy2(ROOT / "scripts" / "bootstrap.sh", copy / "scripts" / "bootstrap.sh")
    for name in ("requirements.lock", "pyproject.toml"):
        shutil.copy2(ROOT / name, copy / name)
    return copy


def _bootstrap(checkout: Path, cwd: Path, tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    stubs = tmp_path / "stubs"
    stubs.mkdir(exist_ok=True)
    _executable(stubs / "python3", FAKE_PYTHON)
    _executable(stubs / "dpkg-query", FAKE_DPKG_QUERY)
    environ = {name: value for name, value in os.environ.items() if name not in ("VENV", "PYTHON")}
    environ.update(PATH=f"{stubs}{os.pathsep}{os.environ['PATH']}", PYTHON=str(stubs / "python3"), **env)
    return subprocess.run([str(checkout / "scripts" / "bootstrap.sh")], cwd=cwd, env=environ, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("venv", [None, ".venv-other"], ids=["default", "relative"])
def test_run_from_another_directory_it_sets_up_the_checkouts_virtualenv_not_one_there(checkout, tmp_path, venv):
    # GIVEN a working directory outside the checkout
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    # WHEN bootstrap.sh is run from there (VENV unset, or a relative path as the Makefile gives)
    done = _bootstrap(checkout, elsewhere, tmp_path, **({"VENV": venv} if venv else {}))

    # THEN the virtualenv is made in the checkout, and nothing in the working directory
    assert done.returncode == 0, done.stderr
    made = checkout / (venv or ".venv")
    assert (made / "bin" / "python").exists()
    assert f"bootstrap: ready ({made})" in done.stdout
    assert list(elsewhere.iterdir()) == []

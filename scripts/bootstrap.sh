#!/usr/bin/env bash
# Sets this checkout up for the tests, the demo and the local stack, skipping whatever is done:
#   1. the Debian packages Ferry needs, installing only the missing ones (apt-get update once first);
#   2. a virtualenv with the pinned dependencies of requirements.lock, and Ferry installed editable.
# Each step leaves a stamp file in the virtualenv, named after a hash of what it set up, so a
# second run only compares stamps and returns within a second or two.
#
# Environment:
#   VENV    the virtualenv to create or update (default .venv; a relative path is taken from the
#           checkout, as the Makefile's is, wherever the script is run from)
#   PYTHON  the interpreter that creates it (default python3)
set -euo pipefail
python=${PYTHON:-python3}
cd "$(dirname "$0")/.."
venv=$(realpath -m "${VENV:-.venv}")

say() { printf 'bootstrap: %s\n' "$*"; }
hash_of() { sha256sum | cut -c1-16; }

# --- 1. Debian packages ---------------------------------------------------------------------------
# libvirt-python builds from source: gcc, pkg-config (only a recommendation of libvirt-dev), the
# libvirt headers and the Python headers of the interpreter in use. qemu-utils grows disk files;
# postgresql serves the tests that run on PostgreSQL.
packages=(libvirt-dev libvirt0 pkg-config gcc qemu-utils postgresql)
py_version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if ! "$python" -c 'import os, sys, sysconfig
sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'; then
  packages+=("python$py_version-dev")
fi
if ! "$python" -c 'import ensurepip' 2>/dev/null; then
  packages+=("python$py_version-venv")
fi
apt_stamp="$venv/.stamp-apt-$(printf '%s\n' "${packages[@]}" | hash_of)"

if [ ! -e "$apt_stamp" ]; then
  if ! command -v dpkg-query >/dev/null; then
    say "not a Debian system: make sure these (or their equivalents) are installed: ${packages[*]}"
  else
    missing=()
    for p in "${packages[@]}"; do
      [ "$(dpkg-query -W -f='${db:Status-Abbrev}' "$p" 2>/dev/null)" = "ii " ] || missing+=("$p")
    done
    if [ ${#missing[@]} -gt 0 ]; then
      if [ "$(id -u)" = 0 ]; then
        as_root=()
      elif command -v sudo >/dev/null; then
        as_root=(sudo)
      else
        say "missing Debian packages and neither root nor sudo: apt-get install ${missing[*]}" >&2
        exit 1
      fi
      say "installing Debian packages: ${missing[*]}"
      "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq
      "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    fi
  fi
fi

# --- 2. virtualenv --------------------------------------------------------------------------------
# The checkout's path is part of the hash: the editable install points at it.
deps_stamp="$venv/.stamp-deps-$({ cat requirements.lock pyproject.toml; pwd; } | hash_of)"

if [ ! -e "$deps_stamp" ]; then
  if [ ! -x "$venv/bin/python" ]; then
    say "creating the virtualenv $venv"
    "$python" -m venv "$venv"
  fi
  say "installing the locked dependencies into $venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -r requirements.lock
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e .
  rm -f "$venv"/.stamp-deps-*
  touch "$deps_stamp"
fi
if [ ! -e "$apt_stamp" ]; then
  rm -f "$venv"/.stamp-apt-*
  touch "$apt_stamp"
fi
say "ready ($venv)"

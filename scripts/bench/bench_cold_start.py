#!/usr/bin/env python3
"""Benchmark cold starts: how long importing each Lambda handler module takes in a fresh process.

For every ``functions/<step>/``, runs ``python -X importtime -c "import app"`` in that folder
with ``layers/core/python`` on PYTHONPATH (what Lambda does with the core layer), a few times,
and reports the best and median cumulative import time of ``app`` in milliseconds, flagging
those over the target (300 ms). ``--top`` lists the slowest modules under the slowest handler.

By default the interpreter is a virtualenv holding only ``layers/core/requirements.txt`` (what
``sam build`` puts in the layer), made under ``.bench/layer-venv`` on the first run, so that
packages only the tests install (format checkers, test tools) do not count; ``--python`` names
another interpreter (``--python .venv/bin/python`` measures the development virtualenv).

    .venv/bin/python scripts/bench/bench_cold_start.py [--repeat 3] [--top 12] [--python PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from importtime import ImportTime, parse_importtime  # noqa: E402 - the sibling modules of this script
from machine import print_header  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TARGET_MS = 300.0
LAYER_REQUIREMENTS = ROOT / "layers" / "core" / "requirements.txt"
LAYER_VENV = ROOT / ".bench" / "layer-venv"


def layer_python() -> Path:
    """The interpreter of a virtualenv holding only the layer's requirements (made when missing or stale)."""
    python, stamp = LAYER_VENV / "bin" / "python", LAYER_VENV / "requirements.txt"
    wanted = LAYER_REQUIREMENTS.read_text()
    if python.exists() and stamp.exists() and stamp.read_text() == wanted:
        return python
    print(f"  making {LAYER_VENV.relative_to(ROOT)} from {LAYER_REQUIREMENTS.relative_to(ROOT)}", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(LAYER_VENV)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "-r",
                    str(LAYER_REQUIREMENTS)], check=True)
    stamp.write_text(wanted)
    return python


def import_app(function_dir: Path, python: Path) -> list[ImportTime]:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "layers" / "core" / "python"), PYTHONDONTWRITEBYTECODE="")
    out = subprocess.run([str(python), "-X", "importtime", "-c", "import app"], cwd=function_dir, env=env,
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"importing {function_dir.name}/app.py failed:\n{out.stderr[-2000:]}")
    return parse_importtime(out.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--python", type=Path, help="the interpreter (default: a virtualenv of the layer's "
                        "requirements, made under .bench/layer-venv)")
    args = parser.parse_args(argv)
    print_header("cold start: python -X importtime -c 'import app' per handler")
    python = args.python or layer_python()
    print(f"  interpreter {python}")
    results: dict[str, list[float]] = {}
    slowest_tree: list[ImportTime] = []
    for function_dir in sorted((ROOT / "functions").iterdir()):
        if not (function_dir / "app.py").is_file():
            continue
        samples = []
        for _ in range(args.repeat):
            entries = import_app(function_dir, python)
            app = next(e for e in entries if e.module == "app")
            samples.append(app.cumulative_us / 1000)
        results[function_dir.name] = samples
        if not slowest_tree or statistics.median(samples) >= max(statistics.median(s) for s in results.values()):
            slowest_tree = entries
    over = 0
    print(f"  {'handler':<28} {'best':>8} {'median':>8}")
    for name, samples in sorted(results.items(), key=lambda item: -statistics.median(item[1])):
        median = statistics.median(samples)
        flag = "  OVER 300 ms" if median > TARGET_MS else ""
        over += bool(flag)
        print(f"  {name:<28} {min(samples):6.0f} ms {median:6.0f} ms{flag}")
    print(f"\n  {over} of {len(results)} handlers over {TARGET_MS:.0f} ms (median of {args.repeat} fresh processes)")
    if args.top and slowest_tree:
        print("\n  heaviest imports (cumulative) under the slowest handler:")
        for entry in sorted(slowest_tree, key=lambda e: -e.cumulative_us)[1 : args.top + 1]:
            print(f"    {entry.cumulative_us / 1000:7.1f} ms  {'  ' * entry.depth}{entry.module}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

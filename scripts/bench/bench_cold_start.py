#!/usr/bin/env python3
"""Benchmark cold starts: how long importing each Lambda handler module takes in a fresh process.

For every ``functions/<step>/``, runs ``python -X importtime -c "import app"`` in that folder
with ``layers/core/python`` on PYTHONPATH (what Lambda does with the core layer), a few times,
and reports the best and median cumulative import time of ``app`` in milliseconds, flagging
those over the target (300 ms). ``--top`` lists the slowest modules under the slowest handler.

By default the interpreter is a virtualenv holding only ``layers/core/python/requirements.txt`` (what
``sam build`` puts in the layer), made under ``.bench/layer-venv`` on the first run, so that
packages only the tests install (format checkers, test tools) do not count; ``--python`` names
another interpreter (``--python .venv/bin/python`` measures the development virtualenv).

Each import runs with ``AWS_LAMBDA_FUNCTION_NAME`` set, as Lambda sets it; Ferry then keeps the
garbage collector paused until the handler's first invocation (see ``ferry/__init__.py``).
``--compare`` also imports each handler without it, alternately, to show what that pause saves.

    .venv/bin/python scripts/bench/bench_cold_start.py [--repeat 3] [--top 12] [--python PATH] [--compare]
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
sys.path.insert(0, str(ROOT / "layers" / "core" / "python"))
from ferry import LAMBDA_VARIABLE  # noqa: E402 - the variable Lambda sets, named by the layer

TARGET_MS = 300.0
LAYER_REQUIREMENTS = ROOT / "layers" / "core" / "python" / "requirements.txt"
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


def import_app(function_dir: Path, python: Path, lambda_environment: bool = True) -> list[ImportTime]:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "layers" / "core" / "python"), PYTHONDONTWRITEBYTECODE="")
    env.pop(LAMBDA_VARIABLE, None)
    if lambda_environment:  # as Lambda sets it: Ferry then pauses the garbage collector while it loads
        env[LAMBDA_VARIABLE] = f"ferry-{function_dir.name}"
    out = subprocess.run([str(python), "-X", "importtime", "-c", "import app"], cwd=function_dir, env=env,
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"importing {function_dir.name}/app.py failed:\n{out.stderr[-2000:]}")
    return parse_importtime(out.stderr)


def app_ms(entries: list[ImportTime]) -> float:
    """The cumulative import time of ``app``, in milliseconds."""
    return next(e for e in entries if e.module == "app").cumulative_us / 1000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--python", type=Path, help="the interpreter (default: a virtualenv of the layer's "
                        "requirements, made under .bench/layer-venv)")
    parser.add_argument("--compare", action="store_true",
                        help=f"also import each handler without {LAMBDA_VARIABLE}, alternately (the garbage "
                        "collector then runs during imports), and print both")
    args = parser.parse_args(argv)
    print_header("cold start: python -X importtime -c 'import app' per handler")
    python = args.python or layer_python()
    print(f"  interpreter {python}; {LAMBDA_VARIABLE} set, as on Lambda"
          + (", and unset alternately (--compare)" if args.compare else ""))
    results: dict[str, list[float]] = {}
    unset: dict[str, list[float]] = {}
    slowest_tree: list[ImportTime] = []
    for function_dir in sorted((ROOT / "functions").iterdir()):
        if not (function_dir / "app.py").is_file():
            continue
        samples = []
        for _ in range(args.repeat):
            entries = import_app(function_dir, python)
            samples.append(app_ms(entries))
            if args.compare:
                unset.setdefault(function_dir.name, []).append(app_ms(import_app(function_dir, python, False)))
        results[function_dir.name] = samples
        if not slowest_tree or statistics.median(samples) >= max(statistics.median(s) for s in results.values()):
            slowest_tree = entries
    over = over_unset = 0
    print(f"  {'handler':<28} {'best':>8} {'median':>8}" + (f" {'unset: median':>14}" if args.compare else ""))
    for name, samples in sorted(results.items(), key=lambda item: -statistics.median(item[1])):
        median = statistics.median(samples)
        flag = "  OVER 300 ms" if median > TARGET_MS else ""
        over += bool(flag)
        line = f"  {name:<28} {min(samples):6.0f} ms {median:6.0f} ms"
        if args.compare:
            without = statistics.median(unset[name])
            over_unset += without > TARGET_MS
            line += f" {without:11.0f} ms"
        print(line + flag)
    print(f"\n  {over} of {len(results)} handlers over {TARGET_MS:.0f} ms (median of {args.repeat} fresh processes)")
    if args.compare:
        print(f"  without {LAMBDA_VARIABLE}: {over_unset} over; median handler "
              f"{statistics.median(statistics.median(v) for v in unset.values()):.0f} ms against "
              f"{statistics.median(statistics.median(v) for v in results.values()):.0f} ms")
    if args.top and slowest_tree:
        print("\n  heaviest imports (cumulative) under the slowest handler:")
        for entry in sorted(slowest_tree, key=lambda e: -e.cumulative_us)[1 : args.top + 1]:
            print(f"    {entry.cumulative_us / 1000:7.1f} ms  {'  ' * entry.depth}{entry.module}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

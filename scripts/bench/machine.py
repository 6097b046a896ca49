"""The machine a benchmark ran on, printed above its figures so they can be compared honestly."""

from __future__ import annotations

import os
import platform
import sqlite3
import subprocess
import sys
from pathlib import Path


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


def postgres_version(url: str | None = None) -> str:
    """The server's version when ``url`` (a SQLAlchemy URL) is given, else the installed server binary's."""
    if url:
        try:
            from sqlalchemy import create_engine, text

            engine = create_engine(url + "postgres" if url.endswith("/") else url)
            with engine.connect() as conn:
                version = conn.execute(text("SHOW server_version")).scalar()
            engine.dispose()
            return f"PostgreSQL {version} (server)"
        except Exception as exc:  # noqa: BLE001 - the description must not fail a benchmark
            return f"PostgreSQL unreachable ({type(exc).__name__})"
    binaries = sorted(Path("/usr/lib/postgresql").glob("*/bin/postgres"))
    if not binaries:
        return "PostgreSQL not installed"
    out = subprocess.run([str(binaries[-1]), "--version"], capture_output=True, text=True, check=False)
    return out.stdout.strip() or "PostgreSQL (unknown version)"


def describe(pg_url: str | None = None) -> str:
    """One block of text: CPU, cores, RAM, OS, Python, SQLite and PostgreSQL versions."""
    lines = [
        f"cpu        {cpu_model()}",
        f"cores      {os.cpu_count()}",
        f"memory     {memory_gib():.1f} GiB",
        f"os         {platform.platform()}",
        f"python     {sys.version.split()[0]} ({platform.python_implementation()})",
        f"sqlite     {sqlite3.sqlite_version}",
        f"postgresql {postgres_version(pg_url)}",
        f"load       {' '.join(f'{v:.2f}' for v in os.getloadavg())} (1/5/15 min, at start)",
    ]
    return "\n".join(lines)


def print_header(title: str, pg_url: str | None = None) -> None:
    print(f"== {title}")
    print(describe(pg_url))
    print()

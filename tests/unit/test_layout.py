"""The repository keeps the layout of DESIGN.md and its layering rules.

- the fixed top level exists;
- the host agent never reaches the database, directly or through a ferry module it imports;
- Lambda handlers stay thin adapters.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FERRY_ROOT = ROOT / "layers/core/python"

LAYOUT_FILES = ["template.yaml"]
LAYOUT_DIRS = [
    "statemachine",
    "functions",
    "layers/core/python/ferry",
    "hostagent",
    "scripts",
    "tests/unit",
    "tests/integration",
    "tests/e2e",
    "docs",
]
# Modules that mean database access; the agent talks only through its queue and Step Functions.
DATABASE_MODULES = ("sqlalchemy", "alembic", "psycopg2", "ferry.store")
HANDLER_MAX_CODE_LINES = 40
HANDLER_FILES = sorted((ROOT / "functions").glob("*/app.py"))


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _imported_modules(path: Path) -> set[str]:
    """Absolute module names a file imports (``from a import b`` counts as a and a.b)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _ferry_module_file(name: str) -> Path | None:
    """The source file of a ferry module, or None when ``name`` is not one (e.g. a class)."""
    base = FERRY_ROOT.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _database_module(name: str) -> str | None:
    """The database module ``name`` is or lies in, if any."""
    return next((db for db in DATABASE_MODULES if name == db or name.startswith(db + ".")), None)


def database_imports(path: Path) -> list[str]:
    """Import chains from ``path`` to a database module, following imports of ferry modules.

    Imports of a ferry module also run its parent packages' ``__init__``, so those are followed too.
    """
    chains: list[str] = []
    seen: set[Path] = set()
    pending: list[tuple[Path, str]] = [(path, _rel(path) if path.is_relative_to(ROOT) else str(path))]
    while pending:
        current, chain = pending.pop()
        if current in seen:
            continue
        seen.add(current)
        for name in sorted(_imported_modules(current)):
            database = _database_module(name)
            if database is not None:
                chains.append(f"{chain} -> {database}")
                continue
            if name.split(".")[0] != "ferry":
                continue
            parts = name.split(".")
            for depth in range(1, len(parts) + 1):
                module = ".".join(parts[:depth])
                module_file = _ferry_module_file(module)
                if module_file is not None:
                    pending.append((module_file, f"{chain} -> {module}"))
    return sorted(set(chains))


def _code_lines(source: str) -> int:
    """Lines holding code: not blank, not only a comment, not part of a docstring."""
    tree = ast.parse(source)
    docstring_lines: set[int] = set()
    documented = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    for node in ast.walk(tree):
        if isinstance(node, documented) and ast.get_docstring(node, clean=False) is not None:
            first = node.body[0]
            docstring_lines.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    skipped = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    lines = {
        line
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type not in skipped
        for line in range(token.start[0], token.end[0] + 1)
    }
    return len(lines - docstring_lines)


@pytest.mark.parametrize("name", LAYOUT_FILES)
def test_layout_file_exists(name):
    assert (ROOT / name).is_file()


@pytest.mark.parametrize("name", LAYOUT_DIRS)
def test_layout_directory_exists(name):
    assert (ROOT / name).is_dir()


def test_host_agent_never_reaches_the_database():
    chains = [chain for module in sorted((ROOT / "hostagent").rglob("*.py")) for chain in database_imports(module)]

    assert chains == []


def test_database_reach_is_found_through_ferry_imports(tmp_path):
    agent = tmp_path / "agent.py"
    agent.write_text("from ferry import errors, store\nimport json\n")

    assert database_imports(agent) == [f"{agent} -> ferry.store"]


def test_handlers_exist():
    assert HANDLER_FILES, "functions/ holds no */app.py"


@pytest.mark.parametrize("app", HANDLER_FILES, ids=_rel)
def test_handler_stays_a_thin_adapter(app):
    source = app.read_text()

    assert _code_lines(source) <= HANDLER_MAX_CODE_LINES
    assert [name for name in _imported_modules(app) if name.split(".")[0] == "sqlalchemy"] == []

"""docs/benchmarks.md's current tables: every row names a date and a command, and the command
exists: the script or module it runs is a file of this repository (`python -m bench.NAME`,
`python -m pdserve.ROOM.MODULE`, `python bench/NAME.py`, `pdserve SUBCOMMAND`), and each flag
it passes is one that script's source, or a repository module it imports, spells out
(`add_argument("--flag"`). Nothing is imported: the sources are read, so this runs in well
under a second and without torch.

The dated sittings behind the rows are in docs/benchmarks_history.md, which the head of
benchmarks.md links to.
"""
from __future__ import annotations

import ast
import functools
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "benchmarks.md"
HISTORY = ROOT / "docs" / "benchmarks_history.md"
START, END = "<!-- current tables: start -->", "<!-- current tables: end -->"
# the folders installed as pdserve's subpackages (setup.py SUBPACKAGES); bench/ runs from the checkout
INSTALLED = ("engine", "kernels", "services", "cli", "sim", "profiler", "autoscale")
PYTHONS = {"python", "python3", ".venv/bin/python", ".venv/bin/python3"}
PDSERVE = {"pdserve", ".venv/bin/pdserve"}
COLUMNS = ("measure", "pdserve", "ratio", "machine", "date", "command")
DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
FLAG = re.compile(r"^--[A-Za-z0-9][\w-]*(=\S*)?$")


@dataclass(frozen=True)
class Row:
    table: str      # the section heading above the table
    line: int       # 1-based, in the document
    cells: dict[str, str]

    def where(self) -> str:
        return f"docs/benchmarks.md:{self.line} ({self.table}: {self.cells.get('measure', '')!r})"


def _cells(line: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def current_tables(text: str) -> list[list[Row]]:
    """The tables between the two markers, each as its rows (header and rule left out)."""
    assert text.count(START) == 1 and text.count(END) == 1, "the current tables' markers"
    first = text[:text.index(START)].count("\n") + 1
    lines = text[text.index(START):text.index(END)].splitlines()
    tables: list[list[Row]] = []
    heading, header = "", None
    for i, line in enumerate(lines):
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        if not line.startswith("|"):
            header = None
            continue
        cells = _cells(line)
        if header is None:
            header = [c.lower() for c in cells]
            tables.append([])
            continue
        if all(set(c) <= set("-: ") for c in cells):
            continue  # the rule under the header
        tables[-1].append(Row(heading, first + i, dict(zip(header, cells))))
    return tables


def commands_of(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def _module_file(dotted: str, run: bool = False) -> Path | None:
    """`bench.serve_goodput` -> bench/serve_goodput.py; `pdserve.sim.autoscale` -> sim/autoscale.py.
    A package is its __init__.py when imported, its __main__.py when run (`run`, `python -m`)."""
    parts = dotted.split(".")
    if parts[0] == "pdserve":
        parts = parts[1:]
        if not parts or parts[0] not in INSTALLED:
            return None
    elif parts[0] != "bench":
        return None
    base = ROOT.joinpath(*parts)
    for path in (base.with_suffix(".py"), *((base / "__main__.py",) if run else ()), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _subcommands() -> dict[tuple[str, ...], str]:
    """`pdserve` subcommand words -> module, read from cli/main.py's COMMANDS (not imported)."""
    tree = ast.parse((ROOT / "cli" / "main.py").read_text())
    found: dict[tuple[str, ...], str] = {}

    def walk(call: ast.Call, prefix: tuple[str, ...]) -> None:
        args = [a.value for a in call.args if isinstance(a, ast.Constant)]
        words = prefix + (args[0],)
        keywords = {k.arg: k.value for k in call.keywords}
        module = args[2] if len(args) > 2 else getattr(keywords.get("module"), "value", "")
        if module:
            found[words] = module
        for sub in getattr(keywords.get("subcommands"), "elts", []):
            walk(sub, words)

    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "COMMANDS" for t in node.targets):
            for call in node.value.elts:
                walk(call, ())
    return found


@functools.lru_cache(maxsize=None)
def _read(path: Path) -> tuple[frozenset[str], tuple[Path, ...]]:
    """The flag-like string literals of one source file, and the repository modules it imports."""
    text = path.read_text()
    imported = []
    for node in ast.walk(ast.parse(text, str(path))):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                 if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
        imported += [target for name in names if (target := _module_file(name)) is not None]
    flags = frozenset(re.findall(r"""["'](--[A-Za-z0-9][\w-]*)["']""", text))
    return flags, tuple(imported)


@functools.lru_cache(maxsize=None)
def _flags_in(path: Path) -> frozenset[str]:
    """The flags `path` or any repository module it imports (transitively) spells out."""
    seen, todo, flags = set(), [path], set()
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        own, imported = _read(current)
        flags |= own
        todo += imported
    return frozenset(flags)


def problems_of_command(command: str) -> list[str]:
    """What is wrong with one command of a row ([] when its script and flags exist)."""
    try:
        words = shlex.split(command)
    except ValueError as e:
        return [f"{command!r}: cannot be split into words ({e})"]
    if not words:
        return ["an empty command"]
    script: Path | None = None
    rest: list[str] = []
    if words[0] in PYTHONS:
        if len(words) > 2 and words[1] == "-m":
            script, rest = _module_file(words[2], run=True), words[3:]
            if script is None:
                return [f"{command!r}: module {words[2]!r} is not a file of the repository"]
        elif len(words) > 1 and words[1].endswith(".py"):
            script, rest = ROOT / words[1], words[2:]
            if not script.is_file():
                return [f"{command!r}: script {words[1]!r} is not a file of the repository"]
        else:
            return [f"{command!r}: runs neither `-m MODULE` nor a .py script"]
    elif words[0] in PDSERVE:
        subcommands = _subcommands()
        chosen = max((k for k in subcommands if tuple(words[1:1 + len(k)]) == k), key=len, default=None)
        if chosen is None:
            return [f"{command!r}: no `pdserve` subcommand {' '.join(words[1:3])!r} in cli/main.py"]
        script, rest = _module_file(subcommands[chosen], run=True), words[1 + len(chosen):]
        if script is None:
            return [f"{command!r}: subcommand module {subcommands[chosen]!r} is not a file of the repository"]
    else:
        return [f"{command!r}: starts with {words[0]!r}, not python, python3, .venv/bin/python or pdserve"]
    known = _flags_in(script)
    # a quoted value holding flags of its own ("--worker-args '--kv-offloading-size 1'") is a value
    flags = [w.split("=", 1)[0] for w in rest if FLAG.match(w)]
    return [f"{command!r}: {script.relative_to(ROOT)} has no flag {flag}" for flag in flags if flag not in known]


def _column(row: Row, name: str) -> str | None:
    """The cell under the first header that starts with `name` ("pdserve" finds "pdserve put / get")."""
    return next((cell for header, cell in row.cells.items() if header.startswith(name)), None)


def problems_of(rows: list[Row]) -> list[str]:
    problems = []
    for row in rows:
        missing = [c for c in COLUMNS if _column(row, c) is None]
        if missing:
            problems.append(f"{row.where()}: no column {missing}")
            continue
        date = _column(row, "date")
        if not (DATE.match(date) or (date == "-" and "not measured" in _column(row, "pdserve"))):
            problems.append(f"{row.where()}: date {date!r} is not YYYY-MM-DD")
        commands = commands_of(_column(row, "command"))
        if not commands:
            problems.append(f"{row.where()}: names no command (a `code span` in its command column)")
        problems += [f"{row.where()}: {p}" for c in commands for p in problems_of_command(c)]
    return problems


def test_the_head_links_the_history_and_holds_the_current_tables():
    text = DOC.read_text()
    assert "(benchmarks_history.md)" in text[:text.index(START)]
    assert HISTORY.is_file()
    tables = current_tables(text)
    assert len(tables) >= 8 and all(tables), [len(t) for t in tables]


def test_every_row_names_a_command_that_exists():
    rows = [row for table in current_tables(DOC.read_text()) for row in table]
    assert problems_of(rows) == []


def test_the_check_finds_a_missing_script_a_missing_flag_and_a_row_without_a_command():
    # the check above could pass by accident (no rows read, every command skipped): here it must fail
    good = "`.venv/bin/python -m bench.serve_goodput --modes adaptive --rates 1.0`"
    cells = {"measure": "m", "pdserve": "1", "ratio": "1", "machine": "x", "date": "2026-12-06"}
    rows = [Row("t", 1, {**cells, "command": good}),
            Row("t", 2, {**cells, "command": "`.venv/bin/python -m bench.no_such_script --rates 1`"}),
            Row("t", 3, {**cells, "command": "`.venv/bin/python -m bench.serve_goodput --no-such-flag 1`"}),
            Row("t", 4, {**cells, "command": "by hand"}),
            Row("t", 5, {**cells, "command": "`pdserve no-such-subcommand --x`", "date": "yesterday"})]
    found = problems_of(rows)
    assert not any(":1 " in p for p in found), found
    assert [p.split(" ", 1)[0] for p in found] == [f"docs/benchmarks.md:{n}" for n in (2, 3, 4, 5, 5)], found
    assert "bench.no_such_script" in found[0] and "--no-such-flag" in found[1] and "names no command" in found[2]


@pytest.mark.parametrize("command", [
    "python -m pdserve.kernels.cpu.benchmark --against HEAD --threads 1,2",
    "pdserve bench serve --dataset random --num-requests 10",
    ".venv/bin/pdserve plan --trace t.jsonl --slo-ttft-ms 300",
    ".venv/bin/python bench/serve_goodput.py --rates 1.0",
    "python3 -m bench.gpu_check --out $OUT",
])
def test_each_way_of_naming_a_command_resolves(command):
    assert problems_of_command(command) == []

"""The package layout holds (issues 15 and 34): read statically from the source, no imports.

* whichever module is imported first, no `from X import name` meets X half-initialised (an import cycle);
* the machinery the callbacks sit on (`core/`, `optim/`, `config/`, `checkpoints.py`, `outputs.py`,
  `reporting/`, `doctor/`, `trainer.py` apart from the ordering helper) never imports `hf_stable.callbacks`, not
  even inside a function;
* no module of hf_stable/, scripts/ or benchmarks/ is over the house style's ~400 lines (`MAX_LINES`);
* no circle of imports, of any length, among hf_stable/'s modules or among benchmarks/' - counting imports inside
  functions and under `if TYPE_CHECKING:` (a circle means two files are one idea, or one is in the wrong place);
* `callbacks/` holds callbacks: every module there but the base, the builders and the ordering helper defines
  the class it is named after (`snr_guard.py` -> `SNRGuard`).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "hf_stable"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PKG.rglob("*.py")}


def _imports(path: Path, module: str, top_level_only: bool) -> set[str]:
    """hf_stable modules `path` imports (resolved to modules that exist; `from pkg import name` of a submodule too)."""
    mods = _modules()
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    out: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:  # relative import
                pkg = module if path.name == "__init__.py" else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    pkg = pkg.rpartition(".")[0]
                base = f"{pkg}.{node.module}"
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if not name.startswith("hf_stable"):
                continue
            while name and name not in mods:
                name = name.rpartition(".")[0]
            if name:
                out.add(name)
    # importing a.b.c runs a/__init__ and a/b/__init__ first
    for name in list(out):
        parts = name.split(".")
        out.update(".".join(parts[:i]) for i in range(1, len(parts)))
    out.discard(module)
    return out


def _import_statements(path: Path, module: str) -> list[tuple[str, list[str]]]:
    """(module, names) for each import run when `path` is imported (not inside functions or TYPE_CHECKING)."""
    out: list[tuple[str, list[str]]] = []

    def walk(nodes):
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                walk(node.orelse)
                continue
            if isinstance(node, ast.Import):
                out.extend((a.name, []) for a in node.names if a.name.startswith("hf_stable"))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = module if path.name == "__init__.py" else module.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        pkg = pkg.rpartition(".")[0]
                    base = f"{pkg}.{base}" if base else pkg
                if base.startswith("hf_stable"):
                    out.append((base, [a.name for a in node.names]))
            walk(ast.iter_child_nodes(node))

    walk(ast.parse(path.read_text()).body)
    return out


def test_every_module_imports_first_without_a_cycle():
    """Simulates Python's import of each module as the first one imported: a `from X import name` while X is
    still initialising (a cycle) is a failure, whichever module a user happens to import first."""
    mods = _modules()
    stmts = {m: _import_statements(p, m) for m, p in mods.items()}
    problems: set[str] = set()

    def simulate(entry: str) -> None:
        status: dict[str, str] = {}

        def ensure(name: str) -> None:
            parts = name.split(".")
            for i in range(1, len(parts) + 1):
                prefix = ".".join(parts[:i])
                if prefix in mods and prefix not in status:
                    load(prefix)

        def load(m: str) -> None:
            status[m] = "loading"
            for target, names in stmts[m]:
                ensure(target)
                for n in names:
                    if f"{target}.{n}" in mods:
                        ensure(f"{target}.{n}")
                    elif status.get(target) == "loading":
                        problems.add(f"{m} imports {n} from {target}, still initialising (first import: {entry})")
            status[m] = "done"

        ensure(entry)

    for entry in sorted(mods):
        simulate(entry)
    assert not problems, "\n".join(sorted(problems)[:10])


def test_machinery_does_not_import_callbacks():
    below = (
        "hf_stable.core",
        "hf_stable.optim",
        "hf_stable.config",
        "hf_stable.checkpoints",
        "hf_stable.outputs",
        "hf_stable.reporting",
        "hf_stable.doctor",
        "hf_stable.distributed",
        "hf_stable.attention",
    )
    offenders = []
    for m, p in _modules().items():
        if m == "hf_stable" or not m.startswith(below):
            continue
        bad = sorted(d for d in _imports(p, m, top_level_only=False) if d.startswith("hf_stable.callbacks"))
        if bad:
            offenders.append(f"{p.relative_to(PKG.parent)} imports {bad}")
    assert not offenders, "\n".join(offenders)


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


def test_each_callback_file_is_named_after_its_class():
    helpers = {"__init__", "base", "builder", "ordering"}
    wrong = []
    files = sorted((PKG / "callbacks").rglob("*.py"))
    for p in files:
        if p.stem in helpers:
            continue
        classes = [n.name for n in ast.parse(p.read_text()).body if isinstance(n, ast.ClassDef)]
        if p.stem not in {_snake(c) for c in classes}:
            wrong.append(f"{p.relative_to(PKG)} defines {classes}")
    assert len(files) > 20 and not wrong, "\n".join(wrong)


# --- Issue 34: module size and the import graph, counting every import ---------------------------------------------

MAX_LINES = 400  # the house style's "files stay under ~400 lines"
ROOT = PKG.parent


def test_no_module_is_over_the_line_limit():
    files = [p for d in ("hf_stable", "scripts", "benchmarks") for p in sorted((ROOT / d).rglob("*.py"))]
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert len(files) > 150, f"only {len(files)} files found under {ROOT}"
    assert not long, f"over {MAX_LINES} lines (split by concept):\n" + "\n".join(long)


def _graph(modules: dict[str, Path], package: str | None) -> dict[str, set[str]]:
    """Edges module -> module for every import statement anywhere in a file: at the top, inside functions and
    inside `if TYPE_CHECKING:` blocks alike. A function-level import still means one file needs the other (the
    issue counts them), and a type-only import still means one file's idea is spelled in the other's terms, so a
    circle through either is a circle of ideas even when Python would never meet it half-initialised.

    `from a.b import name` is an edge to a/b/name.py when that is a module, else to a/b (its file or its
    `__init__.py`); importing a.b.c is not also an edge to a/__init__.py and a/b/__init__.py, so a package
    `__init__` that re-exports its submodules does not close a false circle with every submodule that imports a
    sibling. `package` is the dotted prefix for relative imports (None: the modules import each other by bare name,
    as benchmarks/ does from its own folder)."""

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {}
    for mod, path in modules.items():
        out: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        pkg = pkg.rpartition(".")[0]
                    base = ".".join(x for x in (pkg, base) if x)
                for a in node.names:
                    sub = f"{base}.{a.name}" if base else a.name
                    targets.append(sub if sub in modules else base)
            for t in targets:
                if package is None and t.startswith("benchmarks."):
                    t = t.removeprefix("benchmarks.")
                if (hit := resolve(t)) is not None and hit != mod:
                    out.add(hit)
        edges[mod] = out
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected component of more than one module (Tarjan), as one circle through it: every circle
    of any length lies inside one of them."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)

    circles = []
    for comp in comps:  # a shortest way back to the component's first module, named in the message
        start, inside = comp[0], set(comp)
        prev: dict[str, str] = {}
        queue, found = [start], None
        while queue and found is None:
            v = queue.pop(0)
            for w in sorted(edges[v] & inside):
                if w == start:
                    found = v
                    break
                if w not in prev:
                    prev[w] = v
                    queue.append(w)
        path = [found]
        while path[-1] != start:
            path.append(prev[path[-1]])
        circles.append([*reversed(path), start] + ([] if len(comp) == len(path) else [f"(all of: {', '.join(comp)})"]))
    return circles


def _show(circles: list[list[str]], to_file) -> str:
    lines = []
    for circle in circles:
        path = [to_file(m) for m in circle if not m.startswith("(")]
        lines.append(" -> ".join(path) + "".join(f" {m}" for m in circle if m.startswith("(")))
    return "\n".join(lines)


def test_the_circle_finder_counts_every_kind_of_import(tmp_path):
    """The checker itself: a three-file circle closed by an import inside a function (one of them relative), one
    closed only under `if TYPE_CHECKING:`, and a package `__init__` that re-exports its submodules (no circle)."""
    files = {
        "pkg/__init__.py": "from pkg.a import A\nfrom pkg.b import B\n",
        "pkg/a.py": "from pkg.b import B\nA = 1\n",
        "pkg/b.py": "B = 2\ndef f():\n    from .c import C\n",
        "pkg/c.py": "import pkg.a\nC = 3\n",
        "pkg/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import e\nfrom pkg import A\n",
        "pkg/e.py": "from pkg.d import *\n",
        "pkg/f.py": "from pkg import a, b\n",  # submodules: edges to a.py and b.py, not to __init__.py
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    mods = {}
    for p in (tmp_path / "pkg").glob("*.py"):
        mods["pkg" if p.stem == "__init__" else f"pkg.{p.stem}"] = p
    edges = _graph(mods, "pkg")
    assert edges["pkg.f"] == {"pkg.a", "pkg.b"} and edges["pkg.d"] == {"pkg.e", "pkg"}
    circles = _cycles(edges)
    assert [c[:-1] if c[-1].startswith("(") else c for c in circles] == [
        ["pkg.a", "pkg.b", "pkg.c", "pkg.a"],
        ["pkg.d", "pkg.e", "pkg.d"],
    ], circles
    assert _show(circles[:1], lambda m: m.replace(".", "/") + ".py") == "pkg/a.py -> pkg/b.py -> pkg/c.py -> pkg/a.py"


def test_no_import_circle_in_the_package():
    mods = _modules()
    edges = _graph(mods, "hf_stable")
    assert "hf_stable.optim.factory" in edges["hf_stable.config.checks"]  # imports inside functions are read
    circles = _cycles(edges)
    assert not circles, "import circles:\n" + _show(circles, lambda m: str(mods[m].relative_to(ROOT)))


def test_no_import_circle_in_the_benchmarks():
    mods = {p.stem: p for p in (ROOT / "benchmarks").glob("*.py") if p.stem != "__init__"}
    edges = _graph(mods, None)
    assert len(mods) > 10 and "rescue_cases" in edges["rescue_harness"]  # bare-name imports are read
    circles = _cycles(edges)
    assert not circles, "import circles:\n" + _show(circles, lambda m: f"benchmarks/{m}.py")

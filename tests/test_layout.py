"""The package layout holds (issue 15): read statically from the source, no imports.

* whichever module is imported first, no `from X import name` meets X half-initialised (an import cycle);
* the machinery the callbacks sit on (`core/`, `optim/`, `config/`, `checkpoints.py`, `outputs.py`,
  `reporting/`, `doctor/`, `trainer.py` apart from the ordering helper) never imports `hf_stable.callbacks`, not
  even inside a function;
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

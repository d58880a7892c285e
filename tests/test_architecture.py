"""The code's shape, checked on its source (AST; nothing is imported): the floors, no import cycles, small modules,
and ``build()`` as a short recipe of stage calls."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"sdk": "dsedge", "runtime": "dsedge.runtime", "toolchain": "dsedge.toolchain", "targets": "dsedge.targets"}
MAX_TOOLCHAIN_LINES = 430


def _modules() -> dict[str, Path]:
    out = {}
    for folder, pkg in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([pkg, *parts])] = path
    return out


MODULES = _modules()


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                lines.update(range(sub.lineno, (sub.end_lineno or sub.lineno) + 1))
    return lines


def _imports(name: str, path: Path) -> set[str]:
    """Every dsedge module ``name`` imports (module level and inside functions; not under TYPE_CHECKING)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = _type_checking_lines(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("dsedge"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("dsedge"):
                continue
            for a in node.names:  # `from . import x` may name a submodule
                sub = f"{mod}.{a.name}"
                found.add(sub if sub in MODULES else mod)
    return found


GRAPH = {name: {m for m in _imports(name, path) if m in MODULES} for name, path in MODULES.items()}


def _floor(module: str) -> str:
    for pkg in ("dsedge.runtime", "dsedge.toolchain", "dsedge.targets"):
        if module == pkg or module.startswith(pkg + "."):
            return pkg
    return "dsedge"


def test_no_toolchain_module_imports_the_top_level_package_or_the_sdk():
    bad = sorted(f"{m} imports {dep}" for m, deps in GRAPH.items() if _floor(m) == "dsedge.toolchain"
                 for dep in deps if _floor(dep) == "dsedge")
    assert bad == []


def test_runtime_and_targets_import_nothing_above_them():
    bad = sorted(f"{m} imports {dep}" for m, deps in GRAPH.items() if _floor(m) in ("dsedge.runtime", "dsedge.targets")
                 for dep in deps if _floor(dep) in ("dsedge", "dsedge.toolchain"))
    assert bad == []


def test_no_import_cycles():
    """Depth-first search over module → imported modules (including imports inside functions)."""
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for dep in sorted(GRAPH[m]):
            if dep == m or dep in (m.rsplit(".", 1)[0],):    # a package's __init__ is not a cycle with itself
                continue
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)
    assert cycles == []


def test_toolchain_modules_stay_small():
    sizes = {m: len(p.read_text(encoding="utf-8").splitlines()) for m, p in MODULES.items()
             if _floor(m) == "dsedge.toolchain"}
    assert {m: n for m, n in sizes.items() if n > MAX_TOOLCHAIN_LINES} == {}


def test_build_is_a_short_recipe_of_stage_calls():
    """``pipeline.build`` ≤ 60 lines, and every toolchain function it calls is a stage (or the config check)."""
    path = MODULES["dsedge.toolchain.pipeline"]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "build")
    assert fn.end_lineno - fn.lineno + 1 <= 60
    origin = {a.asname or a.name: node.module for node in tree.body if isinstance(node, ast.ImportFrom)
              for a in node.names}
    called = {c.func.id for c in ast.walk(fn) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
    called |= {a.id for c in ast.walk(fn) if isinstance(c, ast.Call) for a in c.args if isinstance(a, ast.Name)
               and a.id in origin}
    toolchain = {n for n in called if n in origin and origin[n] and origin[n] != "dataclasses"
                 and not origin[n].startswith(("typing", "runtime."))}  # runtime helpers (storage errors) are not stages
    stages = {n for n in toolchain if origin[n].startswith("stages.")}
    assert toolchain - stages <= {"plan_build"}, toolchain - stages
    passed = [a for c in ast.walk(fn) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id == "run"
              for a in c.args[1:2]]
    assert 8 <= len(passed) <= 11


@pytest.mark.parametrize("floor", ["sdk", "runtime"])
def test_device_side_never_imports_torch(floor):
    hits = []
    for path in (ROOT / floor).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            hits += [f"{path.name}: {n}" for n in names if n == "torch" or n.startswith("torch.")]
    assert hits == []

"""The package's import structure: no cycles, no private names across modules, and a
command line that loads without torch (docs/architecture.md)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "autoshard"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path, type_checking: bool = False) -> list[tuple[str, list[str], bool]]:
    """(module, names, at module level) of every autoshard import that runs (not under
    ``if TYPE_CHECKING``; those too when ``type_checking``)."""
    found: list[tuple[str, list[str], bool]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child) and not type_checking:
                continue
            if isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                if child.module.split(".")[0] == "autoshard":
                    names = [a.name for a in child.names]
                    subs = [
                        f"{child.module}.{n}"
                        for n in names
                        if (PACKAGE.parent / f"{child.module}.{n}".replace(".", "/")).exists()
                        or (
                            PACKAGE.parent / (f"{child.module}.{n}".replace(".", "/") + ".py")
                        ).exists()
                    ]
                    found.append((child.module, names, top))
                    found.extend((s, [], top) for s in subs)
            elif isinstance(child, ast.Import):
                for a in child.names:
                    if a.name.split(".")[0] == "autoshard":
                        found.append((a.name, [], top))
            is_scope = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            visit(child, top and not is_scope)

    visit(ast.parse(path.read_text()), True)
    return found


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _graph(top_only: bool) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        deps = set()
        for module, _, top in _imports(path):
            if top_only and not top:
                continue
            # importing a.b.c runs a and a.b too; a package's __init__ is a module of its own
            parts = module.split(".")
            for k in range(2, len(parts) + 1):
                dep = ".".join(parts[:k])
                if dep in MODULES and dep != name:
                    deps.add(dep)
        graph[name] = deps
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(u: str) -> list[str] | None:
        state[u] = 1
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                return stack[stack.index(v) :] + [v]
            if v not in state and (found := dfs(v)):
                return found
        stack.pop()
        state[u] = 2
        return None

    for u in sorted(graph):
        if u not in state and (found := dfs(u)):
            return found
    return None


def test_the_cycle_check_finds_a_planted_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("top_only", [True, False], ids=["module level", "with function level"])
def test_no_import_cycles(top_only):
    """Counting the imports inside functions too: none of them dodges a cycle."""
    cycle = _cycle(_graph(top_only))
    assert cycle is None, " -> ".join(cycle)


def _package(module: str) -> str:
    """``autoshard.cost.mesh`` -> ``cost``; a top-level module is a package of its own."""
    return module.split(".")[1] if "." in module else module


def _package_graph() -> dict[str, set[str]]:
    """Package -> the packages it imports, every import counted: module level, inside
    functions, and under ``if TYPE_CHECKING`` (an annotation is a dependency too)."""
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        if name == "autoshard":  # the root's lazy API attribute is the package's front door
            continue
        deps = graph.setdefault(_package(name), set())
        for module, _, _ in _imports(path, type_checking=True):
            if module != "autoshard" and _package(module) != _package(name):
                deps.add(_package(module))
    for deps in list(graph.values()):
        for d in deps:
            graph.setdefault(d, set())
    return graph


FLOORS = (
    "_torch_private",
    "errors",
    "interrupt",
    "units",
    "placements",
    "model",
    "trace",
    "strategies",
    "cost",
    "plan",
    "solver",
    "pipeline",
    "launch",
    "calibrate",
    "api",
    "bench",
    "cli",
)
"""The packages (and top-level modules) from the bottom floor up (docs/architecture.md)."""


def test_no_package_cycles():
    cycle = _cycle(_package_graph())
    assert cycle is None, " -> ".join(cycle)


def test_every_package_imports_only_floors_below_it():
    """``model`` < ``trace`` < ``strategies`` < ``cost`` < ``plan`` < ``solver`` <
    ``pipeline`` < ``launch`` ...: no package imports one above it, not even for an
    annotation (an upward import that closes no cycle yet is one waiting to)."""
    graph = _package_graph()
    assert set(graph) == set(FLOORS), set(graph) ^ set(FLOORS)
    floor = {name: k for k, name in enumerate(FLOORS)}
    upward = [f"{a} -> {b}" for a, deps in graph.items() for b in deps if floor[b] >= floor[a]]
    assert not upward, upward


def test_the_package_graph_sees_function_level_and_annotation_imports(tmp_path):
    """The check would catch the cycles it was written against: a function-level import
    (``plan/report.py`` once imported ``solver.ilp`` inside a function) and a
    ``TYPE_CHECKING`` one (``cost/overlap.py`` once imported ``strategies.graph`` so)."""
    planted = tmp_path / "m.py"
    planted.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from autoshard.strategies.graph import StrategyGraph\n"
        "def f():\n"
        "    from autoshard.solver.ilp import solve\n"
    )
    seen = {m for m, _, _ in _imports(planted, type_checking=True)}
    assert {"autoshard.strategies.graph", "autoshard.solver.ilp"} <= seen
    assert "autoshard.strategies.graph" not in {m for m, _, _ in _imports(planted)}
    graph = _package_graph()
    assert "strategies" in graph["cost"] and "cost" not in graph["strategies"]
    assert "plan" in graph["solver"] and "solver" not in graph["plan"]


def test_no_module_imports_another_modules_private_names():
    offenders = [
        f"{name} imports {module}.{n}"
        for name, path in MODULES.items()
        for module, names, _ in _imports(path)
        for n in names
        if n.startswith("_") and not n.startswith("__") and module != "autoshard"
    ]
    assert not offenders, offenders


def test_only_torch_private_reaches_into_torch_privates():
    """torch's private modules (``torch._*``, ``torch.utils._pytree``...) are used through
    autoshard/_torch_private.py only, so a torch upgrade breaks one file."""
    offenders = []
    for name, path in MODULES.items():
        if name == "autoshard._torch_private":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            modules = []
            if isinstance(node, ast.ImportFrom) and node.module:
                modules = [node.module]
            elif isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            for m in modules:
                if m.split(".")[0] == "torch" and any(p.startswith("_") for p in m.split(".")):
                    offenders.append(f"{name}: {m}")
    assert not offenders, offenders


def test_the_command_line_loads_without_torch_highspy_or_the_pipeline():
    """``autoshard --help`` must answer at once: importing the CLI loads no heavy library."""
    code = (
        "import sys, autoshard.cli.main\n"
        "heavy = [m for m in ('torch', 'highspy', 'cvxpy', 'scipy', 'numpy', 'transformers') "
        "if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "", f"importing the CLI loads {out.stdout.strip()}"


@pytest.mark.slow  # a fresh interpreter (5 s)
def test_the_solver_modules_load_cvxpy_only_to_build_a_program():
    """cvxpy (1.3 s to import) is imported inside autoshard.solver.cvx's functions: loading
    the solver (as ``show`` and the report do, through the plan) does not load it."""
    code = (
        "import sys, autoshard.solver.ilp, autoshard.solver.solve, autoshard.solver.cvx\n"
        "print('cvxpy' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "False"


def test_every_command_is_registered():
    from autoshard.cli.main import main

    assert sorted(main.commands) == [
        "calibrate",
        "compare",
        "export",
        "launch",
        "show",
        "solve",
        "stages",
    ]


def test_the_public_api_plans_a_model_as_the_command_line_does(tmp_path):
    """The docstring's example, on the MLP: the API's plan is the CLI's plan."""
    from click.testing import CliRunner

    from autoshard import api
    from autoshard.cli.main import main

    mlp = ROOT / "examples" / "mlp.py"
    config = api.SolveConfig(model_path=mlp, mesh=api.MeshSpec.from_options("2x2"))
    result = api.plan_model(config)
    files = api.write_outputs(
        result.plan, tmp_path / "api", "mlp_2x2", config.cost_model(), result.solver_stats()
    )
    out = CliRunner().invoke(main, ["solve", str(mlp), "--mesh", "2x2", "--out", str(tmp_path)])
    assert out.exit_code == 0, out.output
    via_api = api.load_sharding_map(next(f for f in files if f.suffix == ".json"))
    via_cli = api.load_sharding_map(tmp_path / "mlp_2x2.json")
    assert via_api.parameters == via_cli.parameters
    assert result.plan.step_time_s > 0
    assert sorted(api.__all__) == sorted(set(api.__all__))
    assert all(hasattr(api, name) for name in api.__all__)


LONG_FUNCTION_LINES = 100


def test_no_function_over_100_lines_in_the_solver_the_launcher_or_the_plan():
    """A function longer than a screenful mixes jobs (issue 31): in ``solver/``,
    ``launch/`` and ``plan/`` none is over 100 lines, ``def`` to its last line."""
    long = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({length} lines)"
        for package in ("solver", "launch", "plan")
        for path in sorted((PACKAGE / package).glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and (length := node.end_lineno - node.lineno + 1) > LONG_FUNCTION_LINES
    ]
    assert not long, long

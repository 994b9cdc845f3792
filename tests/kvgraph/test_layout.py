"""The package's shape: no import cycles, imports run down the layers, no module too long to
read, `import kvgraph` is lean.

Layers, from the bottom: leaves (config, graph_mode, errors, devices, version, forward_context,
the op names), cpu (the CPU kernels and weight layouts), kv_cache, attention, compilation and
kv_transfer (one level, side by side), runtime. A module may import its own layer and those below; `passes` imports nothing of
kvgraph.

Two graphs, for two questions. Cycles are looked for among every import: at module level,
inside functions and under `if TYPE_CHECKING:` alike, relative ones resolved, and `from package
import module` as an import of that module. A function-level or type-only import that closes a
circle still makes two modules that cannot be read, moved or tested one without the other, and
deferring the import only hides that. Layering reads module-level imports only: a lower layer
may still call into a higher one lazily, where a registry or a Protocol would cost more than it
clarifies.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYERS = {"cpu": 1, "kv_cache": 2, "attention": 3, "compilation": 4, "kv_transfer": 4, "runtime": 5}
LEAVES = {"kvgraph.attention.op_names"}
# Past this a module holds a second idea (STYLE.md: around 250 lines is the signal to look).
MAX_MODULE_LINES = 320


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def top_level_imports(path: Path) -> set[str]:
    """Modules imported at module level, outside `if TYPE_CHECKING:` blocks."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for child in [node] + (list(ast.walk(node)) if isinstance(node, (ast.If, ast.Try)) else []):
            names |= imported_names(child, path)
    return names


def every_import(path: Path) -> set[str]:
    """Modules imported anywhere in the file: module level, functions, TYPE_CHECKING blocks."""
    return {name for node in ast.walk(ast.parse(path.read_text()))
            for name in imported_names(node, path)}


def imported_names(node: ast.AST, path: Path) -> set[str]:
    """What one import statement may name: each module, and for `from X import Y` also `X.Y`
    (Y may be a module); a relative `from .X import Y` is resolved against `path`'s package."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    if not isinstance(node, ast.ImportFrom):
        return set()
    base = node.module or ""
    if node.level:
        package = module_name(path).split(".")
        if path.name != "__init__.py":
            package = package[:-1]
        anchor = package[:len(package) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
    return {base} | {f"{base}.{alias.name}" for alias in node.names}


def import_graph(package: str, imports: Callable[[Path], set[str]] = top_level_imports
                 ) -> dict[str, set[str]]:
    modules = {module_name(p): p for p in (ROOT / package).rglob("*.py")}
    return {name: {m for m in imports(path) if m in modules and m != name}
            for name, path in modules.items()}


def rank(module: str) -> int:
    parts = module.split(".")
    if module in LEAVES or len(parts) < 2:
        return 0
    return LAYERS.get(parts[1], 0)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` as its path (first module repeated at the end), or None."""
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state:
                cycle = visit(target, path + [target])
                if cycle:
                    return cycle
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module, [module])
            if cycle:
                return cycle
    return None


@pytest.mark.parametrize("package", ["kvgraph", "passes"])
def test_no_import_cycles_not_even_inside_functions(package):
    cycle = find_cycle(import_graph(package, every_import))
    assert cycle is None, f"import cycle: {' -> '.join(cycle or [])}"


def test_the_cycle_check_sees_function_type_checking_and_relative_imports():
    source = ("from typing import TYPE_CHECKING\n"
              "if TYPE_CHECKING:\n    from .summary import Summary\n"
              "def report():\n    from kvgraph.inspect import units\n")
    path = ROOT / "kvgraph" / "inspect" / "findings.py"
    names = {name for node in ast.walk(ast.parse(source)) for name in imported_names(node, path)}
    assert {"kvgraph.inspect.summary", "kvgraph.inspect.units"} <= names
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"b"}}) == ["b", "c", "b"]


def test_imports_run_down_the_layers():
    upward = [f"{source} -> {target}" for source, targets in import_graph("kvgraph").items()
              if source != "kvgraph" for target in targets if rank(target) > rank(source)]
    assert not upward, "imports from a higher layer:\n" + "\n".join(sorted(upward))


def test_passes_know_nothing_of_kvgraph():
    for path in (ROOT / "passes").rglob("*.py"):
        assert not [m for m in every_import(path) if m.split(".")[0] == "kvgraph"], path


@pytest.mark.parametrize("package", ["kvgraph", "passes"])
def test_no_module_is_longer_than_one_can_read(package):
    lengths = {path: len(path.read_text().splitlines()) for path in (ROOT / package).rglob("*.py")}
    long = [f"{path.relative_to(ROOT)}: {lines} lines" for path, lines in sorted(lengths.items())
            if lines > MAX_MODULE_LINES]
    assert not long, (f"modules over {MAX_MODULE_LINES} lines (split each along a seam):\n"
                      + "\n".join(long))


def modules_import_kvgraph_loads(*prefixes: str) -> list[str]:
    """The modules named by `prefixes` that `import kvgraph` loads in a fresh process."""
    code = (f"import sys, kvgraph; print(sorted(m for m in sys.modules if m.startswith("
            f"{prefixes!r})))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    return ast.literal_eval(result.stdout.strip())


def test_import_kvgraph_loads_no_backend_or_platform_it_does_not_need():
    # The two interfaces only: no backend's kernels, no platform (torch_npu, CUDA graphs).
    assert modules_import_kvgraph_loads(
        "kvgraph.runtime.platforms.", "kvgraph.attention.backends.", "torch_npu") == [
        "kvgraph.attention.backends.base", "kvgraph.runtime.platforms.base"]


def test_import_kvgraph_leaves_dynamo_and_inductor_for_the_first_compile():
    # Dynamo's import is about a second: the scripts' flag checks and --help do without it.
    assert modules_import_kvgraph_loads("torch._dynamo", "torch._inductor") == []


def test_the_public_api_is_what_its_users_need_and_every_error():
    import kvgraph
    import kvgraph.errors

    assert all(hasattr(kvgraph, name) for name in kvgraph.__all__)
    errors = {name for name, value in vars(kvgraph.errors).items()
              if isinstance(value, type) and issubclass(value, Exception)}
    assert errors == {"BatchError", "CompileError", "ConfigError", "ForwardContextError",
                      "GraphError", "KVCacheError", "PlatformError", "RunnerError", "VerifyError"}
    assert errors <= set(kvgraph.__all__)
    assert len(kvgraph.__all__) <= 30, "each public name is a promise: keep the surface small"

"""The package's shape: no import cycles, imports run down the layers, `import kvgraph` is lean.

Layers, from the bottom: leaves (config, errors, devices, version, forward_context, the op
names), cpu (the CPU kernels and weight layouts), kv_cache, attention, compilation, runtime. A module may import its own layer and those
below; `passes` imports nothing of kvgraph. Imports inside functions and under TYPE_CHECKING are
not edges: they are how a lower layer names a higher one without depending on it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = {"cpu": 1, "kv_cache": 2, "attention": 3, "compilation": 4, "runtime": 5}
LEAVES = {"kvgraph.attention.op_names"}


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
            if isinstance(child, ast.Import):
                names |= {alias.name for alias in child.names}
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                names.add(child.module)
                names |= {f"{child.module}.{alias.name}" for alias in child.names}
    return names


def import_graph(package: str) -> dict[str, set[str]]:
    modules = {module_name(p): p for p in (ROOT / package).rglob("*.py")}
    return {name: {m for m in top_level_imports(path) if m in modules and m != name}
            for name, path in modules.items()}


def rank(module: str) -> int:
    parts = module.split(".")
    if module in LEAVES or len(parts) < 2:
        return 0
    return LAYERS.get(parts[1], 0)


def test_no_import_cycles():
    graph = import_graph("kvgraph")
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph[module]):
            assert state.get(target) != "open", f"import cycle: {' -> '.join(path + [target])}"
            if target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_imports_run_down_the_layers():
    upward = [f"{source} -> {target}" for source, targets in import_graph("kvgraph").items()
              if source != "kvgraph" for target in targets if rank(target) > rank(source)]
    assert not upward, "imports from a higher layer:\n" + "\n".join(sorted(upward))


def test_passes_know_nothing_of_kvgraph():
    for path in (ROOT / "passes").rglob("*.py"):
        assert not [m for m in top_level_imports(path) if m.split(".")[0] == "kvgraph"], path


def test_import_kvgraph_loads_no_backend_or_platform_it_does_not_need():
    code = ("import sys, kvgraph; print(sorted(m for m in sys.modules if m.startswith("
            "('kvgraph.runtime.platforms.', 'kvgraph.attention.backends.', 'torch_npu'))))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    # The two interfaces only: no backend's kernels, no platform (torch_npu, CUDA graphs).
    assert result.stdout.strip() == ("['kvgraph.attention.backends.base', "
                                     "'kvgraph.runtime.platforms.base']")


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

"""The package's architecture, checked from its source: imports point down the layers, never up,
and no module imports itself back through others.

Layers, top to bottom (a module may import its own package or any layer below it):

    cli → workflows → callbacks → models → pruning → metrics → data → reporting → causal → hub → storage → distributed → errors

``storage`` (atomic writes, the run lock) is file infrastructure: every layer that writes may use it.

Every ``import`` counts, also one inside a function: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "fairprune"

LAYERS = ["cli", "workflows", "callbacks", "models", "pruning", "metrics", "data", "reporting", "causal", "hub", "storage memory", "distributed", "errors"]
RANK = {name: len(LAYERS) - i for i, layer in enumerate(LAYERS) for name in layer.split()}
RANK["__init__"] = 0  # the package's own __init__ holds the version only


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Every fairprune module ``path`` imports (``from fairprune.x import y`` counts ``x.y`` when
    that is a module, else ``x``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "fairprune")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "fairprune":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in MODULES else node.module)
    return found


FILES = sorted(PACKAGE.rglob("*.py"))
MODULES = {module_name(f): f for f in FILES}
GRAPH = {name: imports_of(path) - {name} for name, path in MODULES.items()}


def top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_top_level_part_has_a_layer():
    unknown = sorted({top(m) for m in MODULES} - set(RANK))
    assert not unknown, f"give these a layer in tests/test_layers.py: {unknown}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module):
    upward = [dep for dep in sorted(GRAPH[module])
              if top(dep) != top(module) and RANK.get(top(dep), 99) >= RANK[top(module)]]
    assert not upward, f"{module} imports {upward}: a layer may only import the layers below it"


def test_no_import_cycle():
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(GRAPH.get(node, ())):
            if dep not in GRAPH:
                continue
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state:
                cycle = visit(dep)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for name in sorted(GRAPH):
        if name not in state:
            cycle = visit(name)
            assert cycle is None, "import cycle: " + " → ".join(cycle)


def test_the_checker_sees_an_upward_import(tmp_path):
    """The rule itself can fail: a data module importing a callback is reported."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from fairprune.callbacks.report import run_dir\n")
    deps = imports_of(bad)
    assert deps == {"fairprune.callbacks.report"}
    assert RANK[top("fairprune.callbacks.report")] > RANK["data"]


def test_no_module_over_450_lines():
    long = {module_name(f): n for f in FILES if (n := len(f.read_text().splitlines())) > 450}
    assert not long, f"split these along their sections: {long}"


#: Where a causal LM's weights are read and its model is built: the causal-model layer (and the
#: hub's file readers below it). The pruning layer above holds the solvers, statistics and
#: selection, and reaches a model only through the block-model interface (causal.blocks.BlockModel).
MODEL_ACCESS = ("fairprune.hub.shards", "fairprune.hub.quantized_stream")


def test_the_causal_layer_is_the_floor_of_model_access():
    """The ``causal`` package sits right above ``hub`` and below every layer that prunes or
    measures; no module of ``pruning`` or ``metrics`` reads model files or builds a causal model."""
    assert RANK["hub"] < RANK["causal"] < min(RANK["reporting"], RANK["metrics"], RANK["pruning"])
    readers = {name for name in MODULES if top(name) in ("pruning", "metrics")
               and (GRAPH[name] & set(MODEL_ACCESS) or "AutoModelForCausalLM" in MODULES[name].read_text())}
    assert not readers, f"model access belongs in fairprune.causal: {sorted(readers)}"
    assert {top(d) for d in GRAPH["fairprune.causal.streamed"]} >= {"hub"}  # the layer that reads them is causal

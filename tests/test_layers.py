"""The package's architecture, checked from its source: imports point down the layers, never up,
and no module imports itself back through others.

Layers, top to bottom (a module may import its own package or any layer below it):

    cli → workflows → callbacks → runs → models → pruning → metrics → data → reporting → causal → hub → storage → distributed → errors

``storage`` (atomic writes, the run lock) is file infrastructure: every layer that writes may use it.

Every ``import`` counts, also one inside a function: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "fairprune"

LAYERS = ["cli", "workflows", "callbacks", "runs", "models", "pruning", "metrics", "data", "reporting", "causal", "hub", "storage memory", "distributed", "errors"]
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


# -- one pass over the blocks ---------------------------------------------------------------------
#: The one loop that visits the blocks one by one, loading each and running it.
THE_PASS = ("fairprune.causal.pipeline", "run")


def block_loops(tree: ast.AST) -> list[tuple[str, int]]:
    """``(enclosing function, line)`` of every loop that loads a part (``.loaded(...)``) or calls a
    block (``call_block`` / ``through``) inside its body: a pass over the blocks."""
    found = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if isinstance(child, (ast.For, ast.While)):
                calls = [c.func for part in child.body for c in _own_nodes(part) if isinstance(c, ast.Call)]
                names = {f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "") for f in calls}
                if names & {"loaded", "call_block", "through"} and not _over_batches(child):
                    found.append((name, child.lineno))
            visit(child, name)

    visit(tree, "")
    return found


def _own_nodes(node: ast.AST):
    """``node`` and what it holds, but not the bodies of functions it defines (a pass's ``flow``)."""
    yield node
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, (ast.Lambda, ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from _own_nodes(child)


def _over_batches(loop: ast.AST) -> bool:
    """A loop over a pass's batches (``for b in batches``), which runs one block on each."""
    return isinstance(loop, ast.For) and "batches" in ast.unparse(loop.iter) and "blocks" not in ast.unparse(loop.iter)


def test_one_loop_over_the_blocks():
    """Measuring, pruning, quantizing, head scoring and removal, zeros and streamed writing all run
    through :func:`fairprune.causal.pipeline.run`: no other loop loads the blocks one by one."""
    loops = {(name, function) for name, path in MODULES.items()
             for function, _ in block_loops(ast.parse(path.read_text(), str(path)))}
    assert loops == {THE_PASS}, f"passes over the blocks outside the pipeline: {sorted(loops - {THE_PASS})}"


def test_the_loop_counter_sees_a_second_pass():
    bad = ast.parse("def measure(blocks):\n    for index, block in enumerate(blocks.blocks):\n"
                    "        with blocks.loaded(block):\n            pass\n")
    assert block_loops(bad) == [("measure", 2)]


#: What a block model keeps of its own: set through its methods (quantize_with, run_on, writer,
#: changed), never assigned from outside its classes.
BLOCK_STATE = {"quantizer", "_quantizer", "_digest", "_device", "_writer", "pruned", "device", "streamed"}


def test_no_streamed_branch_and_no_block_state_set_outside_the_causal_layer():
    read, written = [], []
    for name, path in MODULES.items():
        if top(name) == "causal":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr == "streamed":
                read.append(f"{name}:{node.lineno}")
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign) else []
            for target in targets:
                if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                        and target.value.id in ("blocks", "kept", "pruned") and target.attr in BLOCK_STATE):
                    written.append(f"{name}:{node.lineno} {target.value.id}.{target.attr}")
    assert not read, f".streamed read outside fairprune.causal: {read}"
    assert not written, f"a block model's state set from outside its class: {written}"


def test_pruning_holds_solvers_and_modifiers_not_runs():
    """The runs (the LM run, the dense figures, the task pass, FASP's run) live in ``fairprune.runs``:
    nothing in ``fairprune.pruning`` saves a run folder or measures a model for a report."""
    run_code = {"fairprune.reporting.runs", "fairprune.storage.folders", "fairprune.metrics.harness"}
    found = {name: sorted(GRAPH[name] & run_code) for name in MODULES if top(name) == "pruning" and GRAPH[name] & run_code}
    assert not found, f"run code in fairprune.pruning: {found}"
    assert not {"fairprune.pruning.lm_run", "fairprune.pruning.dense", "fairprune.pruning.tasks",
                "fairprune.pruning.fasp.run"} & set(MODULES)
    import fairprune.runs.fasp as fasp

    lines = len(ast.unparse(next(n for n in ast.parse(Path(fasp.__file__).read_text()).body
                                 if isinstance(n, ast.FunctionDef) and n.name == "run_fasp")).splitlines())
    assert lines < 60, f"run_fasp is {lines} lines"

"""The layers of shared/DESIGN.md held: every import in workbench/ points down the table, and no two packages (nor
two modules) import each other. Read from the source with `ast`, nothing imported: a fraction of a second.

An import counts wherever it is written: at the top of a module, inside a function (imported when called), or
under `if TYPE_CHECKING:` (for the layers: a name in an annotation still ties the text to the module it names).
Cycles are counted over the imports that run, so a module may name in annotations the type of what a module
above it hands it.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "workbench"

LAYER_OF = {
    # pure values: under everything
    "workbench.config": "pure values", "workbench.schedules": "pure values", "workbench.links": "pure values", "workbench.expert_links": "pure values",
    "workbench.hardware": "pure values", "workbench.flops": "pure values",
    "workbench.machine": "pure values",  # the cores and memory ranks share; what is measured of them, kept
    "workbench.launch": "pure values",  # how a run's ranks spread over machines: the shape exports are written from
    "workbench.corpus": "pure values",  # where the text to train on is, checked
    "workbench.documents": "pure values", "workbench.tokens": "pure values",  # a corpus's documents, as tokens
    "workbench.shards": "pure values",  # a corpus's tokens cached in one mapped file (numpy, no torch)
    "workbench.model_profile": "pure values",  # what one sequence does in each block, as the estimator reads it
    "workbench.checkpoints": "pure values",  # the checkpoint format: manifest, layout, content-addressed chunks
    # predictions
    "workbench.estimate": "predictions", "workbench.plan": "predictions",
    # models: definitions and the protocol the engine lays out; torch and transformers, no distribution, no
    # processes, so that the notebook can build a model on the meta device (to trace it) without the engine
    "workbench.models": "models",
    # control plane
    "workbench.pool": "control plane",
    # rank side
    "workbench.telemetry": "telemetry", "workbench.emulation": "emulation", "workbench.engine": "engine",
    # notebook side
    "workbench.workbench": "notebook side", "workbench.kernel": "notebook side", "workbench.recovery": "notebook side",
    "workbench.rank_session": "notebook side", "workbench.compare": "notebook side",
    "workbench.training": "notebook side", "workbench.emulated": "notebook side",
    "workbench.checkpointing": "notebook side",
    "workbench.export": "notebook side", "workbench.export_torchtitan": "notebook side",
    "workbench.doctor": "notebook side", "workbench.magics": "notebook side",
    "workbench.telemetry.store": "notebook side", "workbench.telemetry.runs": "notebook side",
    "workbench.telemetry.run_summary": "notebook side",
    "workbench.emulation.predict": "notebook side",  # the estimator's prediction for an emulated cluster
    "workbench.tracing": "notebook side",  # any model traced on fake tensors, for the estimator
    # screen
    "workbench.ui": "screen",
    # what a person starts: the package (`import workbench as wb`) and the batch entry point (a rank with a report)
    "workbench": "entry points", "workbench.train": "entry points",
    "workbench.__main__": "entry points",  # python -m workbench --prepare-ahead: the standby, before a kernel asks
}
"""The layer of each module: its longest prefix here."""

BELOW = ("pure values", "predictions", "control plane")
MAY_IMPORT = {
    "pure values": {"pure values"},
    "predictions": {"pure values", "predictions"},
    "control plane": {"pure values", "control plane"},
    "models": {"pure values", "models"},
    # rank side: never engine ← telemetry, never engine → emulation, never the estimator on a rank
    "telemetry": {"pure values", "control plane", "telemetry"},
    "emulation": {"pure values", "control plane", "telemetry", "emulation"},
    "engine": {"pure values", "control plane", "telemetry", "models", "engine"},
    "notebook side": {*BELOW, "models", "telemetry", "emulation", "engine", "notebook side"},
    "screen": {"pure values", "predictions", "telemetry", "notebook side", "screen"},
    "entry points": {*BELOW, "models", "telemetry", "emulation", "engine", "notebook side", "screen", "entry points"},
}

NOT_WITHIN = {("workbench.schedules", "workbench.config"): "config imports schedules, not the other way"}
"""Directions inside a layer (prefix of the importer, prefix of the imported)."""

OPENS_THE_SCREEN = {("workbench.workbench", "workbench.ui.dashboard"), ("workbench.workbench", "workbench.ui.report")}
"""The facade's one method per user action includes opening the screen (`bench.dashboard()`, `bench.report()`):
imported when called, never by the screen's own modules at run time."""


@dataclass(frozen=True)
class Import:
    source: str
    """The importing module."""
    target: str
    """The imported module (the package's own modules only)."""
    where: str
    """file:line."""
    runs: bool
    """False under `if TYPE_CHECKING:`: only annotations read it."""


def modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports(known: dict[str, Path], root: Path = ROOT) -> list[Import]:
    """Every import of a workbench module by another, in every module."""
    found = []
    for module, path in known.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and _is_type_checking(block.test)
                       for stmt in block.body for n in ast.walk(stmt)}
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                named = [a.name for a in node.names if a.name.split(".")[0] == "workbench"]
                # a module that does not exist (yet) resolves to the package itself: an import guarded by ImportError
                targets = [t for t, name in ((_resolve(n, known), n) for n in named) if t != "workbench" or name == t]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                if base.split(".")[0] != "workbench":
                    continue
                # `from workbench import hardware` imports the module workbench.hardware; `from x import Name`, x.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else _resolve(base, known)
                           for a in node.names]
                if base != "workbench" and _resolve(base, known) == "workbench":
                    continue  # a module that does not exist (yet): an import guarded by ImportError
            rel = path.relative_to(root.parent).as_posix()
            found += [Import(module, t, f"{rel}:{node.lineno}", id(node) not in typing_only)
                      for t in dict.fromkeys(targets) if t is not None and t != module]
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def layer(module: str) -> str:
    prefix = _resolve(module, LAYER_OF)
    assert prefix != "workbench" or module == "workbench", f"{module} has no layer: give it one in LAYER_OF"
    return LAYER_OF[prefix]


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def against_the_layers(found: list[Import]) -> list[str]:
    """Each import that runs against the table, as 'file:line: a (layer) imports b (layer)'."""
    out = []
    for imp in found:
        a, b = layer(imp.source), layer(imp.target)
        if (imp.source, imp.target) in OPENS_THE_SCREEN:
            continue
        why = next((why for (src, dst), why in NOT_WITHIN.items()
                    if _under(imp.source, src) and _under(imp.target, dst)), None)
        if b not in MAY_IMPORT[a]:
            why = f"{a} may import only {', '.join(sorted(MAY_IMPORT[a]))}"
        if why:
            out.append(f"{imp.where}: {imp.source} ({a}) imports {imp.target} ({b}): {why}")
    return out


def package(module: str) -> str:
    """workbench.<first part>: a subpackage, or a top-level module."""
    return ".".join(module.split(".")[:2])


def cycles(edges: dict[tuple[str, str], str]) -> list[list[str]]:
    """The strongly connected groups of more than one node of the graph `edges` ((a, b) -> where a imports b)."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups = []

    def visit(v: str) -> None:  # Tarjan's
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while (w := stack.pop()) != v:
                group.append(w)
            if group:
                groups.append(sorted([v, *group]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def _describe(group: list[str], edges: dict[tuple[str, str], str]) -> str:
    inside = [f"{a} → {b} ({where})" for (a, b), where in sorted(edges.items()) if a in group and b in group]
    return " ⇄ ".join(group) + ": " + "; ".join(inside)


def import_cycles(found: list[Import]) -> list[str]:
    """Packages that import each other, and modules that do, through imports that run."""
    between_packages: dict[tuple[str, str], str] = {}
    between_modules: dict[tuple[str, str], str] = {}
    for imp in found:
        if not imp.runs:
            continue
        between_modules.setdefault((imp.source, imp.target), imp.where)
        if package(imp.source) != package(imp.target) and package(imp.source) != "workbench":
            between_packages.setdefault((package(imp.source), package(imp.target)), imp.where)
    return ([f"package cycle {_describe(g, between_packages)}" for g in cycles(between_packages)]
            + [f"module cycle {_describe(g, between_modules)}" for g in cycles(between_modules)])


def test_every_import_points_down_the_layers():
    wrong = against_the_layers(imports(modules()))
    assert not wrong, "imports against the layers of shared/DESIGN.md:\n" + "\n".join(wrong)


def test_no_two_packages_or_modules_import_each_other():
    found = import_cycles(imports(modules()))
    assert not found, "cycles:\n" + "\n".join(found)


def test_the_reader_sees_every_kind_of_import(tmp_path):
    # The checks are only as good as the reading: a lazy import, a relative one, one under TYPE_CHECKING and
    # `from workbench import module` are all found, and a layer break and a cycle among them are reported.
    pkg = tmp_path / "workbench"
    (pkg / "config").mkdir(parents=True)
    (pkg / "engine").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "config" / "__init__.py").write_text("from .run import Config\n")
    (pkg / "config" / "run.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from workbench.engine import model\nConfig = 1\n")
    (pkg / "engine" / "__init__.py").write_text("")
    (pkg / "engine" / "model.py").write_text("def f():\n    from workbench import config\n")
    (pkg / "engine" / "trainer.py").write_text("from workbench.engine.model import f\nimport workbench.config.run\n")
    known = modules(pkg)
    found = imports(known, pkg)
    assert {(i.source, i.target, i.runs) for i in found} == {
        ("workbench.config", "workbench.config.run", True),
        ("workbench.config.run", "workbench.engine.model", False),
        ("workbench.engine.model", "workbench.config", True),
        ("workbench.engine.trainer", "workbench.engine.model", True),
        ("workbench.engine.trainer", "workbench.config.run", True)}
    assert [w.split(":")[0] for w in against_the_layers(found)] == ["workbench/config/run.py"]
    edges = {("a", "b"): "a.py:1", ("b", "c"): "b.py:1", ("c", "a"): "c.py:1", ("c", "d"): "c.py:2"}
    assert cycles(edges) == [["a", "b", "c"]]

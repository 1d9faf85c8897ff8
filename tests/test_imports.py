"""The package's imports, read from its source: every import (a function's lazy one and a type
checker's too) points down the layers below, and no module reaches itself through others."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "batchserve"

# Lowest first; a module may import from its own layer (without a circle) or any below it.
LAYERS: tuple[tuple[str, ...], ...] = (
    (
        "settings",
        "draft_config",
        "config",
        "jsonl",
        "heap",
        "threads",
        "native_build",
        "request",
        "text",
        "detokenize",
        "trees",
        "cost_profile",
        "v1",
    ),
    ("draft", "grammar", "kernels"),
    ("records",),  # the step's records: read by scheduler, runner, engine and server alike
    ("speculation",),  # which drafts a step verifies: the engine owns it, the scheduler never sees it
    ("scheduler", "attention"),
    ("model",),
    ("runner",),
    ("resume", "admission", "pipeline", "engine", "serving_loop", "async_engine", "llm"),
    ("server",),
    ("bench", "tune", "cli", "__init__"),
)
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}


def _top(module: str) -> str:
    """batchserve.speculation.planner -> speculation; batchserve.engine -> engine."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    """Module -> the batchserve modules it imports (a name imported from a package, where that
    name is a module, counts as that module)."""
    paths = {_module(p): p for p in PACKAGE.rglob("*.py") if "v1" not in p.relative_to(PACKAGE).parts}
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        here = module if path.name == "__init__.py" else module.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                if base.startswith("batchserve"):
                    edges |= {f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names}
            elif isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name.startswith("batchserve")}
        graph[module] = {e for e in edges if e != module}
    return graph


def _layer(module: str) -> int:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    assert top in LAYER, f"{module}: put its package in a layer of tests/test_imports.py"
    return LAYER[top]


def test_every_import_points_down_the_layers() -> None:
    upward = [
        f"{m} -> {t}" for m, targets in _graph().items() for t in targets if _layer(t) > _layer(m)
    ]  # fmt: skip
    assert not upward, "imports that run back up:\n" + "\n".join(sorted(upward))


def test_no_module_reaches_itself_through_others() -> None:
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    circles: list[list[str]] = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                circles.append([*path[path.index(t) :], t])
            elif t in graph and t not in state:
                visit(t, [*path, t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


def test_the_analysis_sees_what_it_must() -> None:
    """The checks above would catch a circle and an upward import: the graph holds both kinds of
    edge where they are known to be (a lazy import, a relative one, a name that is a module)."""
    graph = _graph()
    assert "batchserve.records" in graph["batchserve.scheduler.scheduler"]
    assert "batchserve.bench.grounded" in graph["batchserve.bench.datasets"]  # imported inside a function
    assert "batchserve.model.loader" in graph["batchserve.runner"]
    assert _layer("batchserve.server.app") > _layer("batchserve.engine") > _layer("batchserve.records")
    assert _layer("batchserve.scheduler.scheduler") > _layer("batchserve.speculation.planner")


# What `scheduler/` may hold: batching (admission, chunks, preemption, blocks, the prefix cache).
SCHEDULER_MODULES = {
    "__init__", "scheduler", "book", "chunks", "commit", "fairness", "pacing", "seats", "block_allocator",
    "prefix_cache",
}  # fmt: skip


def test_the_scheduler_only_batches_and_sees_drafts_as_data() -> None:
    """`scheduler/` holds the batching modules alone and imports neither speculation nor the
    drafters: it reserves the slots of draft trees handed to it as data (`records.StepDrafts`)."""
    here = {p.stem for p in (PACKAGE / "scheduler").glob("*.py")}
    assert here == SCHEDULER_MODULES, f"scheduler/ holds more than batching: {sorted(here - SCHEDULER_MODULES)}"
    graph = _graph()
    reached = {
        t for m, targets in graph.items() if m.startswith("batchserve.scheduler") for t in targets
        if t.startswith(("batchserve.speculation", "batchserve.draft."))
    }  # fmt: skip
    assert not reached, sorted(reached)


# Each of these packages has one owner in the product: the only package outside it that imports
# it. The bench's drafter simulation is the one measurement that reaches past the owner.
OWNERS = {"speculation": "engine", "draft": "speculation"}


def test_speculation_and_the_drafters_have_one_owner_each() -> None:
    graph = _graph()
    for package, owner in OWNERS.items():
        importers = {
            _top(m) for m, targets in graph.items() for t in targets
            if _top(t) == package and _top(m) not in (package, "bench")
        }  # fmt: skip
        assert importers == {owner}, f"{package}/ is imported by {sorted(importers)}, not by {owner} alone"


def test_the_servers_wings_stand_apart() -> None:
    """server/: the gRPC wing and the OpenAI wing never import each other (they meet in the
    shared core: `frontend`, `samples`, `metrics`, and `app`, which assembles both); gRPC is known
    to the gRPC wing, the client (and its command) and `app` alone, FastAPI to the OpenAI wing alone."""
    graph = _graph()
    wings = ("batchserve.server.grpc", "batchserve.server.openai")
    crossing = [
        f"{m} -> {t}" for m, targets in graph.items() for t in targets for a, b in (wings, wings[::-1])
        if m.startswith(a) and t.startswith(b)
    ]  # fmt: skip
    assert not crossing, crossing
    for path in PACKAGE.rglob("*.py"):
        module = _module(path)
        if module.startswith("batchserve.v1"):
            continue
        roots = {
            (a.name if isinstance(node, ast.Import) else node.module or "").split(".")[0]
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Import | ast.ImportFrom) and not getattr(node, "level", 0)
            for a in (node.names if isinstance(node, ast.Import) else [node])
        }
        if "grpc" in roots:
            assert module.startswith("batchserve.server.grpc") or module in {
                "batchserve.server.client",
                "batchserve.server.client_cli",
                "batchserve.server.app",
            }, module
        if roots & {"fastapi", "starlette"}:
            assert module.startswith("batchserve.server.openai"), module


def test_the_step_reads_draft_trees_as_data() -> None:
    """The records, the runner and the attention take a request's draft tree and Jacobi window,
    and their masks, from `batchserve.trees`: none of them knows a drafter (`draft/`)."""
    graph = _graph()
    readers = ("batchserve.records", "batchserve.runner", "batchserve.attention")
    reach = [
        f"{m} -> {t}"
        for m, ts in graph.items()
        for t in ts
        if m.startswith(readers) and t.startswith("batchserve.draft")
    ]
    assert not reach, reach

"""The bench is a client of the product: its modules import from batchserve only the public API,
read from their source (every import, a function's lazy one and a type checker's too).

The public API, module by module (`batchserve/bench/__init__.py` says the same):
- `batchserve`: the package's `__all__` (LLM, AsyncEngine, EngineCore, SamplingParams,
  RequestOutput, FinishReason, Submission);
- `batchserve.config` (every setting), `batchserve.request` (a request's parameters, outputs,
  stats), `batchserve.records` (what `EngineCore.step_listeners` are told), `batchserve.cost_profile`
  (`CostProfile`, what `batchserve calibrate` writes);
- `batchserve.server.client` (`Client`);
- `batchserve.model.loader` (what `--model` names: its file, weights and tokenizer), and
  `batchserve.model.gguf_read` / `gguf_file` (a GGUF's header and its tensors as mapped views);
- `batchserve.heap`, `batchserve.jsonl` (the heap as `serve` settles it; JSONL reading).

Two bench modules may reach past it, and no other: `bench/host.py` (the engine below its public
API: the host-side stand-in that times scheduler, speculation and commit without a model, and the
model-side handles the public API lacks) and `bench/simulate.py` (the drafters and the adaptive
policy, owned by the engine, replayed offline)."""

from __future__ import annotations

import ast

from tests.test_imports import PACKAGE, _graph

PUBLIC = frozenset(
    {
        "batchserve",
        "batchserve.config",
        "batchserve.request",
        "batchserve.records",
        "batchserve.cost_profile",
        "batchserve.server.client",
        "batchserve.model.loader",
        "batchserve.model.gguf_read",  # the GGUF header reader: real-shaped files are written and read back with it
        "batchserve.model.gguf_file",  # a GGUF's tensors as mapped views: a file is requantized from them
        "batchserve.heap",
        "batchserve.jsonl",
    }
)
INTERNAL = frozenset({"batchserve.bench.host", "batchserve.bench.simulate"})


def _package_exports() -> set[str]:
    """The names in `batchserve/__init__.py`'s `__all__`."""
    for node in ast.parse((PACKAGE / "__init__.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    raise AssertionError("batchserve/__init__.py has no __all__")


def _reaches(graph: dict[str, set[str]]) -> list[str]:
    """`module -> target` for every import of a bench module (but the two named) that is neither
    the bench's own nor the public API."""
    return sorted(
        f"{m} -> {t}"
        for m, targets in graph.items()
        if m.startswith("batchserve.bench") and m not in INTERNAL
        for t in targets
        if not t.startswith("batchserve.bench") and t not in PUBLIC
    )


def test_the_bench_imports_only_the_public_api() -> None:
    reaches = _reaches(_graph())
    assert not reaches, "bench modules reaching past the public API (or into bench/host.py, simulate.py):\n" + (
        "\n".join(reaches)
    )


def test_what_the_bench_takes_from_the_package_is_exported() -> None:
    """`from batchserve import X`: X is in the package's `__all__` (or a public module)."""
    exported = _package_exports() | {m.rpartition(".")[2] for m in PUBLIC if m.count(".") == 1}
    taken = {
        f"{path.relative_to(PACKAGE.parent)}: {a.name}"
        for path in (PACKAGE / "bench").glob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.module == "batchserve" and not node.level
        for a in node.names
        if a.name not in exported
    }
    assert not taken, sorted(taken)


def test_the_internal_modules_are_the_two_named_and_reach_past_it() -> None:
    """The exemption is not idle: each of the two named modules does reach past the public API,
    and the check would catch a bench module that did (the analysis sees function-local imports)."""
    graph = _graph()
    assert INTERNAL <= graph.keys()
    for module in INTERNAL:
        assert any(not t.startswith("batchserve.bench") and t not in PUBLIC for t in graph[module]), module
    assert "batchserve.runner.calibrate" in graph["batchserve.bench.host"]  # imported inside a function
    planted = {**graph, "batchserve.bench.runs": graph["batchserve.bench.runs"] | {"batchserve.engine"}}
    assert _reaches(planted) == ["batchserve.bench.runs -> batchserve.engine"]


def test_tune_is_a_product_command_beside_the_cli() -> None:
    """`batchserve tune` lives in `batchserve/tune/`, not in the bench; the bench never imports it."""
    assert not list((PACKAGE / "bench").glob("tune*.py"))
    assert (PACKAGE / "tune" / "__init__.py").exists()
    graph = _graph()
    assert not [f"{m} -> {t}" for m, ts in graph.items() if m.startswith("batchserve.bench") for t in ts
                if t.startswith("batchserve.tune")]  # fmt: skip

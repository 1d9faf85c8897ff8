"""The package's shape: small rooms, short functions, a stated job per module, imports one way."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "batchserve"
GENERATED = PACKAGE / "v1"  # protoc output (make proto)
MAX_FILE_LINES = 350
MAX_FUNCTION_LINES = 60
# Layers that stay pure Python, so the scheduler and drafters can be reasoned about (and
# tested) without a model: no torch, no gRPC, nothing from the layers above them.
ABOVE_PURE = ("torch", "grpc", "batchserve.runner", "batchserve.attention", "batchserve.engine", "batchserve.server")
PURE = {"scheduler": ABOVE_PURE, "speculation": ABOVE_PURE, "draft": ABOVE_PURE, "grammar": ABOVE_PURE}
ONLY_SERVER_KNOWS_GRPC = ("grpc", "grpc_health", "grpc_reflection", "batchserve.v1")


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if GENERATED not in p.parents)


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _imports(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_states_its_job_and_stays_small(path: Path) -> None:
    tree = _tree(path)
    doc = ast.get_docstring(tree)
    assert doc and doc.splitlines()[0].strip(), f"{path.name}: open with a one-line docstring of the module's job"
    num_lines = len(path.read_text().splitlines())
    assert num_lines <= MAX_FILE_LINES, f"{path.name} has {num_lines} lines; split it by job"
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1  # type: ignore[operator]
            assert length <= MAX_FUNCTION_LINES, f"{path.name}:{node.lineno} {node.name} is {length} lines"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_one_way(path: Path) -> None:
    imports = _imports(_tree(path))
    layer = path.relative_to(PACKAGE).parts[0]
    if layer in PURE:
        bad = sorted(i for i in imports if _under(i, PURE[layer]))
        assert not bad, f"{layer}/ must stay pure Python: {path.name} imports {bad}"
    if layer != "server":
        bad = sorted(i for i in imports if _under(i, ONLY_SERVER_KNOWS_GRPC))
        assert not bad, f"only server/ knows gRPC: {path.name} imports {bad}"


def test_the_checks_see_what_they_check() -> None:
    # The walk must reach the package's modules and the function bodies inside them.
    paths = _modules()
    assert PACKAGE / "engine.py" in paths and not any(GENERATED in p.parents for p in paths)
    assert "torch" in _imports(_tree(PACKAGE / "runner" / "runner.py"))
    assert _under("batchserve.runner.runner", PURE["scheduler"]) and not _under("torchvision", ("torch",))

"""The docs cite only what exists: every relative link and every file or folder named in backticks
in the hand-written docs (README, docs/, the benchmarks' index and log, the deploy and load-test
READMEs) resolves to a path in the repository."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted(
    {
        ROOT / "README.md",
        *ROOT.glob("docs/*.md"),
        ROOT / "benchmarks" / "README.md",
        ROOT / "benchmarks" / "HISTORY.md",
        *ROOT.glob("deploy/**/README.md"),
        *ROOT.glob("load_tests/*.md"),
    }
)
LINK = re.compile(r"\]\(([^)\s]+)\)")
# `some/path.ext`, `dir/sub/`, optionally `:line` or `:a-b`: what reads as a repository path.
CODE = re.compile(r"`([A-Za-z0-9_.\-]+(?:/[A-Za-z0-9_.\-]*)+)(?::\d+(?:-\d+)?)?`")
SUFFIXES = (".py", ".md", ".json", ".cpp", ".h", ".yaml", ".yml", ".toml", ".proto", ".sh", ".csv", ".txt", ".jsonl")
TOP = ("batchserve/", "tests/", "docs/", "benchmarks/", "load_tests/", "deploy/", "scripts/", "protos/", "results/")


def _cited(doc: Path) -> list[str]:
    text = doc.read_text(encoding="utf-8")
    links = [t.split("#", 1)[0] for t in LINK.findall(text) if not re.match(r"[a-z]+:|#|mailto:", t)]
    paths = [p for p in CODE.findall(text) if p.endswith(SUFFIXES) or p.startswith(TOP)]
    return [p for p in links + paths if p and not p.startswith(("/", "~", "-")) and "*" not in p]


def _exists(doc: Path, path: str) -> bool:
    """Whether `path` names something inside the repository (resolved from the doc's folder, the
    root, the package or the benchmarks): a path that leaves the repository is never found, since
    a clone has nothing beside it."""
    bases = (doc.parent, ROOT, ROOT / "batchserve", ROOT / "benchmarks")
    for base in bases:
        target = (base / path).resolve()
        if target.is_relative_to(ROOT) and target.exists():
            return True
    return False


def test_the_docs_are_found() -> None:
    names = {d.relative_to(ROOT).as_posix() for d in DOCS}
    assert {"README.md", "docs/serving.md", "benchmarks/README.md", "benchmarks/HISTORY.md"} <= names


def test_every_path_the_docs_cite_exists() -> None:
    missing = [f"{doc.relative_to(ROOT)}: {path}" for doc in DOCS for path in _cited(doc) if not _exists(doc, path)]
    assert not missing, "the docs cite paths that do not exist:\n" + "\n".join(missing)


def test_the_check_catches_a_missing_path(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text("see [this](gone/file.md) and `batchserve/nothing_here.py:12`, not `--a/--b`", encoding="utf-8")
    assert _cited(doc) == ["gone/file.md", "batchserve/nothing_here.py"]
    assert not any(_exists(doc, p) for p in _cited(doc))
    assert _exists(ROOT / "README.md", "docs/serving.md")
    assert not _exists(ROOT / "docs" / "design.md", "../../README.md")  # outside the repository

"""Input-grounded workloads, from text every Python installation ships: answers that copy
much of their prompt, the case model-free drafts exist for.

- `code-edit`: a function or class from the standard library's own sources and an instruction
  whose answer repeats most of it (type hints, a docstring, a renamed identifier, comments).
- `doc-qa`: a section of the standard library's documentation (`pydoc_data`'s topics) and a
  question answered from it (the retrieval-augmented shape of Lookahead's main result).
- `summarize`: the same sections, to be summarized.

Selection is deterministic for a given Python version: files and topics in sorted order,
candidates taken round-robin across files so that no one module dominates."""

from __future__ import annotations

import ast
import functools
import io
import itertools
import json
import re
import sysconfig
import tokenize
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from batchserve.bench.samples import Sample

MIN_LINES, MAX_LINES = 6, 40  # a code-edit snippet: long enough to copy, short enough to answer
MIN_CHARS, MAX_CHARS = 500, 2400  # a documentation passage (about 120-600 tokens)

# (edit, instruction): what the answer must do to the code; every answer repeats most of it.
EDITS = (
    ("type-hints", "Add type hints to every parameter and return value. Change nothing else."),
    ("docstring", "Add a concise docstring to every function and method that lacks one. Change nothing else."),
    ("rename", "Rename the identifier `{old}` to `{new}` everywhere it appears. Change nothing else."),
    ("comments", "Add a short comment above each non-trivial block explaining why it is there. Change nothing else."),
)
QUESTIONS = (
    "Using only the documentation above, explain {topic}.",
    "According to the passage above, what are the rules for {topic}? Quote the sentences that say so.",
    "Answer from the documentation above: how does Python handle {topic}? Give an example from the passage.",
)


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _snippets(path: Path) -> Iterator[tuple[str, str]]:
    """(name, source) of the module's top-level functions and classes of MIN_LINES..MAX_LINES
    lines, in file order."""
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return
    lines = source.splitlines()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.end_lineno:
            # Slicing lines: ast.get_source_segment re-splits the whole file per node.
            segment = "\n".join(lines[node.lineno - 1 : node.end_lineno])
            if MIN_LINES <= node.end_lineno - node.lineno + 1 <= MAX_LINES and "\t" not in segment:
                yield node.name, segment


def _round_robin(groups: list[list[tuple[str, str, str]]]) -> Iterator[tuple[str, str, str]]:
    for batch in itertools.zip_longest(*groups):
        yield from (x for x in batch if x is not None)


def rename_target(code: str) -> str | None:
    """The identifier a `rename` edit renames: the snippet's first parameter (not self/cls) or
    assigned name of at least 3 characters, or None."""
    try:
        node = ast.parse(code).body[0]
    except (SyntaxError, IndexError):
        return None
    names = []
    for n in ast.walk(node):
        if isinstance(n, ast.arg) and n.arg not in ("self", "cls"):
            names.append(n.arg)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            names.append(n.id)
    return next((n for n in names if len(n) >= 3), None)


def rename(code: str, old: str, new: str) -> str:
    """`code` with every NAME token `old` replaced by `new` (strings and comments untouched)."""
    out, last = [], 0
    lines = code.splitlines(keepends=True)
    starts = [0, *itertools.accumulate(len(line) for line in lines)]
    for tok in tokenize.generate_tokens(io.StringIO(code).readline):
        if tok.type == tokenize.NAME and tok.string == old:
            at = starts[tok.start[0] - 1] + tok.start[1]
            out.append(code[last:at] + new)
            last = at + len(old)
    return "".join(out) + code[last:]


@functools.cache
def _candidates() -> tuple[tuple[str, str, str], ...]:
    """(module, name, source) of every snippet, round-robin across the public modules (parsing
    the whole standard library takes seconds: once per process)."""
    groups = []
    for path in sorted(stdlib_dir().glob("*.py")):
        if path.stem.startswith("_"):  # private helpers: not code a user edits
            continue
        found = [(path.stem, name, code) for name, code in _snippets(path)]
        if found:
            groups.append(found)
    return tuple(_round_robin(groups))


def code_edit(limit: int = 400) -> list[Sample]:
    """Snippets of the standard library with an edit instruction each (EDITS in turn); the
    reference answer is the edited code where the edit is mechanical (rename), else the code
    as it stands (the answer repeats most of it)."""
    out: list[Sample] = []
    for module, name, code in _candidates():
        if len(out) >= limit:
            break
        edit, instruction = EDITS[len(out) % len(EDITS)]
        reference = code
        if edit == "rename":
            old = rename_target(code)
            if old is None:
                edit, instruction = EDITS[0]
            else:
                new = f"{old}_renamed"
                instruction = instruction.format(old=old, new=new)
                reference = rename(code, old, new)
        prompt = f"{instruction}\n\n```python\n{code}\n```"
        # The prediction a client sends (OpenAI's predicted outputs): the code being edited.
        original = f"```python\n{code}\n```"
        out.append(Sample(f"{module}.{name}/{edit}", prompt, f"```python\n{reference}\n```", True, (), original))
    return out


_HEADING = re.compile(r"^(.+)\n([=*\-^~]{3,})$", re.MULTILINE)


def doc_passages() -> list[tuple[str, str]]:
    """(topic, passage) of the documentation topics pydoc ships: each topic cut at its headings
    and then into runs of whole paragraphs of MIN_CHARS..MAX_CHARS characters."""
    from pydoc_data.topics import topics

    out = []
    for key in sorted(topics):
        text = topics[key].replace("\r\n", "\n").strip()
        sections = _HEADING.split(text)
        # split() gives [before, title, underline, body, title, underline, body, ...]
        titled = [(key.replace("-", " "), sections[0])]
        titled += [(sections[i].strip(), sections[i + 2]) for i in range(1, len(sections) - 2, 3)]
        for title, body in titled:
            chunk = ""
            for para in (p.strip("\n") for p in body.split("\n\n")):
                if chunk and len(chunk) + len(para) > MAX_CHARS:
                    if MIN_CHARS <= len(chunk) <= MAX_CHARS:  # (one paragraph may be longer)
                        out.append((title, chunk))
                    chunk = ""
                chunk = f"{chunk}\n\n{para}" if chunk else para
            if MIN_CHARS <= len(chunk) <= MAX_CHARS:
                out.append((title, chunk))
    return out


def _first_paragraphs(passage: str, chars: int = 600) -> str:
    """A grounded answer's stand-in: the passage's opening paragraphs, up to about `chars`."""
    out = ""
    for para in passage.split("\n\n"):
        if out and len(out) + len(para) > chars:
            break
        out = f"{out}\n\n{para}" if out else para
    return out


def doc_qa(limit: int = 400) -> list[Sample]:
    """A documentation passage followed by a question about it (QUESTIONS in turn)."""
    out = []
    for i, (topic, passage) in enumerate(doc_passages()[:limit]):
        question = QUESTIONS[i % len(QUESTIONS)].format(topic=topic)
        prompt = f"Read this section of the Python documentation.\n\n{passage}\n\n{question}"
        out.append(Sample(f"doc-qa/{i}", prompt, _first_paragraphs(passage), chat=True))
    return out


def summarize(limit: int = 400) -> list[Sample]:
    """A documentation passage to summarize."""
    out = []
    for i, (_, passage) in enumerate(doc_passages()[:limit]):
        prompt = f"Summarize this section of the Python documentation in a few sentences.\n\n{passage}"
        out.append(Sample(f"summarize/{i}", prompt, _first_paragraphs(passage), chat=True))
    return out


# json-extract: what each schema asks of a passage, in turn. Bounded strings and arrays: a small
# model may not close an unbounded one before max_new_tokens.
_TEXT = {"type": "string", "maxLength": 200}
_WORDS = {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 5}
SCHEMAS = (
    {"topic": {"type": "string", "maxLength": 80}, "summary": _TEXT, "keywords": _WORDS},
    {"title": {"type": "string", "maxLength": 80}, "has_code_example": {"type": "boolean"}, "terms": _WORDS},
    {
        "subject": {"type": "string", "maxLength": 80},
        "kind": {"enum": ["syntax", "semantics", "library", "other"]},
        "first_sentence": _TEXT,
    },
)


def _schema(i: int) -> dict[str, Any]:
    props = SCHEMAS[i % len(SCHEMAS)]
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def _filled(i: int, topic: str, passage: str) -> str:
    """A plausible answer (the dev split's warm-up output): the passage's own words."""
    first = passage.split(". ")[0].replace("\n", " ")[:200]
    words = [w for w in re.findall(r"[A-Za-z_]{4,}", passage)][:5]
    values: tuple[Any, ...] = (
        (topic, first, words),
        (topic, ">>>" in passage, words),
        (topic, "semantics", first),
    )[i % len(SCHEMAS)]
    return json.dumps(dict(zip(SCHEMAS[i % len(SCHEMAS)], values)), ensure_ascii=False)


def json_extract(limit: int = 400) -> list[Sample]:
    """A documentation passage and a JSON Schema to fill from it; the output is constrained to it."""
    out = []
    for i, (topic, passage) in enumerate(doc_passages()[:limit]):
        schema = json.dumps(_schema(i))
        prompt = (
            f"Read this section of the Python documentation.\n\n{passage}\n\n"
            f"Answer with a JSON object that matches this JSON Schema:\n{schema}"
        )
        out.append(Sample(f"json-extract/{i}", prompt, _filled(i, topic, passage), chat=True, constraint=schema))
    return out

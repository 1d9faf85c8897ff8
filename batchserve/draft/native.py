"""The drafter's native code (csrc/): tries, indexed texts and retrieval in C++, one extension
module (`_batchserve_draft`) built with g++ on first use and by `make setup`
(`python -m batchserve.draft`), once per source, compiler and Python, into
$BATCHSERVE_CACHE_DIR/draft (else ~/.cache/batchserve/draft): about 3 s.

Portable code (no -march=native): drafting is pointer chasing and hashing, not arithmetic. Where
it cannot be built there is no lookahead drafter: `library()` raises DrafterUnavailable with the
reason and what to do, which the engine reports at start-up."""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from types import ModuleType

from batchserve import native_build

log = logging.getLogger(__name__)

SOURCES = tuple(sorted((Path(__file__).parent / "csrc").glob("*.cpp")))
HEADERS = tuple(sorted((Path(__file__).parent / "csrc").glob("*.h")))
FLAGS = ("-O2", "-std=c++17", "-shared", "-fPIC")
ABI_VERSION = 2  # kAbiVersion of the source this module's calls describe (module.cpp)
MODULE = "_batchserve_draft"


class DrafterUnavailable(RuntimeError):
    """The native drafter cannot be built or loaded here; the message says why and what to do."""


def build() -> Path:
    """The built module's path, compiled now unless already built; raises DrafterUnavailable."""
    try:
        return native_build.build("the native drafter", "draft", "batchserve_draft", SOURCES, HEADERS, FLAGS)
    except native_build.BuildFailed as e:
        raise DrafterUnavailable(f"{e}; without it only --draft none or --draft llma can run") from None


@functools.cache
def library() -> ModuleType:
    """The loaded module (built on first use); raises DrafterUnavailable."""
    lib = native_build.load(MODULE, build())
    if lib.abi_version() != ABI_VERSION:
        raise DrafterUnavailable(f"{lib.__file__} is not this version's build")
    return lib


def main() -> None:
    """`python -m batchserve.draft`: build now (make setup), or say why not."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        print(f"the native drafter: {build()}")
    except DrafterUnavailable as e:  # setup goes on: `--draft none` still serves, and start-up says why
        print(f"the native drafter cannot be built here (the lookahead drafter will not start): {e}")

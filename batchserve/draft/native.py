"""The drafter's native code (csrc/): tries, indexed texts and retrieval in C++, one extension
module (`_batchserve_draft`, bound with nanobind, whose library compiles in beside it) built with
g++ on first use and by `make setup` (`python -m batchserve.draft`), once per source, compiler,
nanobind and Python, into $BATCHSERVE_CACHE_DIR/draft (else ~/.cache/batchserve/draft): about 8 s.

Portable code (no -march=native): drafting is pointer chasing and hashing, not arithmetic. Where
it cannot be built there is no lookahead drafter: `library()` raises DrafterUnavailable with the
reason and what to do, which the engine reports at start-up.

The module exports its constants (csrc/constants.h); `library()` refuses a build whose constants
disagree with what Python names too (MATCH_CAP, the layouts), so each is defined once."""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from types import ModuleType

from batchserve import native_build
from batchserve.draft_config import DRAFT_LAYOUTS
from batchserve.trees import MATCH_CAP

log = logging.getLogger(__name__)

SOURCES = tuple(sorted((Path(__file__).parent / "csrc").glob("*.cpp")))
HEADERS = tuple(sorted((Path(__file__).parent / "csrc").glob("*.h")))
# -fvisibility=hidden and -fno-strict-aliasing: what nanobind's own build gives its library.
FLAGS = ("-O2", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden", "-fno-strict-aliasing")
ABI_VERSION = 3  # kAbiVersion of the source this module's calls describe (csrc/binding.h)
MODULE = "_batchserve_draft"
LAYOUT_CODES = {name: code for code, name in enumerate(DRAFT_LAYOUTS)}  # what the module's LAYOUTS must be


class DrafterUnavailable(RuntimeError):
    """The native drafter cannot be built or loaded here; the message says why and what to do."""


def _binder() -> tuple[tuple[Path, ...], tuple[str, ...], bytes]:
    """nanobind's part of the build: its library's source, the include flags, and its version (a
    new version builds anew); raises DrafterUnavailable without it."""
    try:
        import nanobind
    except ImportError:
        raise DrafterUnavailable(
            "nanobind is not installed (pip install nanobind, or make setup); without it only --draft none "
            "or --draft llma can run"
        ) from None
    root = Path(nanobind.__file__).parent
    includes = (f"-I{nanobind.include_dir()}", f"-I{root / 'ext' / 'robin_map' / 'include'}")
    return (Path(nanobind.source_dir()) / "nb_combined.cpp",), includes, f"nanobind {nanobind.__version__}".encode()


def build() -> Path:
    """The built module's path, compiled now unless already built; raises DrafterUnavailable."""
    library_sources, includes, key = _binder()
    sources, flags = (*SOURCES, *library_sources), (*FLAGS, *includes)
    try:
        return native_build.build("the native drafter", "draft", "batchserve_draft", sources, HEADERS, flags, key)
    except native_build.BuildFailed as e:
        raise DrafterUnavailable(f"{e}; without it only --draft none or --draft llma can run") from None


@functools.cache
def library() -> ModuleType:
    """The loaded module (built on first use); raises DrafterUnavailable."""
    lib = native_build.load(MODULE, build())
    if lib.abi_version() != ABI_VERSION:
        raise DrafterUnavailable(f"{lib.__file__} is not this version's build")
    if lib.MATCH_CAP != MATCH_CAP or dict(lib.LAYOUTS) != LAYOUT_CODES:
        raise DrafterUnavailable(
            f"{lib.__file__} disagrees with batchserve's constants: MATCH_CAP {lib.MATCH_CAP} (Python {MATCH_CAP}), "
            f"layouts {dict(lib.LAYOUTS)} (Python {LAYOUT_CODES})"
        )
    return lib


def main() -> None:
    """`python -m batchserve.draft`: build now (make setup), or say why not."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        print(f"the native drafter: {build()}")
    except DrafterUnavailable as e:  # setup goes on: `--draft none` still serves, and start-up says why
        print(f"the native drafter cannot be built here (the lookahead drafter will not start): {e}")

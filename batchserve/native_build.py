"""Our C++ sources built into CPython extension modules, once per source, compiler and machine.

Two packages ship native code this way: `batchserve.kernels` (the CPU kernels, which need torch)
and `batchserve.draft` (the drafter, which must not). Each names its sources, flags and cache
folder; a build lands in $BATCHSERVE_CACHE_DIR/<folder> (else ~/.cache/batchserve/<folder>) under
a name keyed by everything it depends on, so a new source, compiler, Python or CPU builds anew,
and `make setup` builds both ahead. Torch-free on purpose."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Sequence
from importlib.machinery import ExtensionFileLoader
from pathlib import Path
from types import ModuleType


class BuildFailed(RuntimeError):
    """The sources could not be built here; the message says why."""


def cache_root(folder: str) -> Path:
    return Path(os.environ.get("BATCHSERVE_CACHE_DIR") or Path.home() / ".cache" / "batchserve") / folder


def build_root(folder: str) -> Path:
    """Where built modules live: $BATCHSERVE_BUILD_DIR, else the cache. A build is named by the hash
    of everything it depends on, so one folder serves every process that builds the same thing
    (a test session's private cache need not rebuild what `make setup` built)."""
    root = os.environ.get("BATCHSERVE_BUILD_DIR")
    return Path(root) / folder if root else cache_root(folder)


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def library_path(
    cxx: str, folder: str, stem: str, files: Sequence[Path], flags: Sequence[str], extra: bytes = b""
) -> Path:
    """Where the build of `files` with `flags` by `cxx` lives (`extra`: whatever else it depends on)."""
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256()
    for part in (*(f.read_bytes() for f in files), version.encode(), " ".join(flags).encode()):
        key.update(part)
    key.update(platform.machine().encode() + sys.version.encode() + extra)  # an extension module per Python
    return build_root(folder) / f"{stem}-{key.hexdigest()[:16]}.so"


def build(
    what: str, folder: str, stem: str, sources: Sequence[Path], headers: Sequence[Path], flags: Sequence[str],
    extra: bytes = b"",
) -> Path:  # fmt: skip
    """The extension module built from `sources`, compiled now unless already built; raises
    BuildFailed saying why (`what` names it in the message)."""
    cxx = compiler()
    if cxx is None:
        raise BuildFailed(f"no C++ compiler (g++) to build {what}: install g++ or set $CXX")
    path = library_path(cxx, folder, stem, [*sources, *headers], flags, extra)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # Compiled beside its final name, then renamed: processes building at once never load half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    python_headers = "-I" + sysconfig.get_paths()["include"]
    cmd = [cxx, *flags, python_headers, *(str(s) for s in sources), "-o", tmp]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        os.unlink(tmp)
        raise BuildFailed(f"{cxx} failed to build {what}: {done.stderr.strip()[-2000:]}")
    os.replace(tmp, path)
    return path


def load(module: str, path: Path) -> ModuleType:
    """Import the extension module `module` from the built file."""
    spec = importlib.util.spec_from_file_location(module, path, loader=ExtensionFileLoader(module, str(path)))
    assert spec is not None and spec.loader is not None
    lib = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lib)
    return lib

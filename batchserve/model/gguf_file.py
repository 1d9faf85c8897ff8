"""A GGUF file read as it is: its header by our reader (`gguf_read`), its config and tokenizer
from that metadata (`gguf_config`, cached by the file's identity: a second start builds no
vocabulary), its tensors as memory-mapped views of the file's own bytes.

Nothing here copies a weight: `GGUFTensors` hands out read-only views of the mapping, and
`release` drops a range's pages from this process once a layer has made its own copy, so a
load's resident memory is the packed layers plus one tensor, not the file twice."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import mmap
import os
import shutil
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from batchserve.model.gguf_read import GGUFContents, read_gguf
from batchserve.model.gguf_tokenizer import match_llama_cpp

logger = logging.getLogger("batchserve")

META_FORMAT = 3  # 2: the tokenizer splits as llama.cpp does (gguf_tokenizer); 3: config and tokenizer from our reader
META_MARKER = "batchserve-gguf-meta.json"  # written last: an entry without it is incomplete
PERMUTED_ARCHS = ("llama",)  # llama.cpp's converter permutes attn_q/attn_k rows for these (rotary pairs)


def meta_cache_dir() -> Path | None:
    """Where a file's config and tokenizer are cached: $BATCHSERVE_MODEL_CACHE_DIR (`off` to
    disable), else $BATCHSERVE_CACHE_DIR/models, else ~/.cache/batchserve/models."""
    value = os.environ.get("BATCHSERVE_MODEL_CACHE_DIR")
    if value is not None:
        return None if value.strip().lower() in ("", "0", "off", "none") else Path(value)
    return Path(os.environ.get("BATCHSERVE_CACHE_DIR") or Path.home() / ".cache" / "batchserve") / "models"


def file_identity(path: Path) -> dict[str, Any]:
    """What a cached reading of `path` depends on: the file (path, size, modification time)."""
    st = path.stat()
    return {"gguf": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _meta_key(path: Path) -> dict[str, Any]:
    return {"format": META_FORMAT, **file_identity(path), "transformers": importlib.metadata.version("transformers")}


def _meta_entry(path: Path) -> Path | None:
    root = meta_cache_dir()
    if root is None:
        return None
    digest = hashlib.sha1(json.dumps(_meta_key(path), sort_keys=True).encode()).hexdigest()[:16]
    return root / f"{path.stem}-meta-{digest}"


def cached_meta(path: Path) -> Path | None:
    """The complete config-and-tokenizer entry for this file, or None."""
    entry = _meta_entry(path)
    if entry is None or not (entry / META_MARKER).is_file():
        return None
    try:
        if json.loads((entry / META_MARKER).read_text()) == _meta_key(path):
            return entry
    except (OSError, ValueError):
        pass
    return None


def read_meta(path: Path) -> tuple[Any, Any]:
    """(config, tokenizer) of a GGUF file from its metadata: from the cache entry where there is
    one, else built from the header our reader parses (`gguf_config`; transformers' own reader
    only for architectures the native forward does not run, whose load is transformers' anyway)
    and cached."""
    from transformers import AutoConfig, AutoTokenizer

    from batchserve.model.gguf_config import LLAMA_CPP_ARCHS, gguf_config

    entry = cached_meta(path)
    if entry is not None:
        try:
            config = AutoConfig.from_pretrained(entry, local_files_only=True)
            tokenizer = AutoTokenizer.from_pretrained(entry, local_files_only=True)
            # Some classes rebuild their splitting rules from vocab and merges when loaded: set again.
            match_llama_cpp(tokenizer, read_gguf(path).metadata)
            config._name_or_path = str(path)  # as read from the file
            return config, tokenizer
        except Exception as e:  # a damaged entry, whatever the damage: parse the file again
            logger.warning("ignoring the cached metadata in %s: %s", entry, e)
            shutil.rmtree(entry, ignore_errors=True)
    contents = read_gguf(path)
    arch = contents.metadata.get("general.architecture")
    if arch is not None and arch.value in LLAMA_CPP_ARCHS:
        config = gguf_config(contents)
    else:
        config = AutoConfig.from_pretrained(path.parent, local_files_only=True, gguf_file=path.name)
    tokenizer = _gguf_tokenizer(contents, config.model_type)
    _write_meta(path, config, tokenizer)
    config._name_or_path = str(path)
    return config, tokenizer


def _gguf_tokenizer(contents: GGUFContents, model_type: str) -> Any:
    """The tokenizer the file describes (`gguf_config.gguf_tokenizer`), as the class `AutoTokenizer`
    would pick for `model_type` (TokenizersBackend where it names none), splitting as llama.cpp does."""
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name

    from batchserve.model.gguf_config import gguf_tokenizer

    name = TOKENIZER_MAPPING_NAMES.get(model_type) or "TokenizersBackend"
    cls = tokenizer_class_from_name(name if isinstance(name, str) else "TokenizersBackend")
    tokenizer = gguf_tokenizer(contents, cls)
    logger.info("tokenizer of %s: %s", contents.path, match_llama_cpp(tokenizer, contents.metadata))
    return tokenizer


def publish_entry(
    entry: Path, fill: Callable[[Path], None], what: str, taken: Callable[[], bool] | None = None
) -> bool:
    """Write a cache entry whole: `fill` writes it into a temporary directory beside `entry`,
    which is then renamed over it, so a reader never sees half an entry and two writers do not
    collide (`taken`: another process wrote it meanwhile; keep theirs). Best effort: a full disk
    or a read-only cache costs the next start its speed, nothing else; False then."""
    tmp: Path | None = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=entry.parent))
        fill(tmp)
        if taken is not None and taken():
            return True
        if entry.exists():  # a stale or damaged entry: replace it
            shutil.rmtree(entry, ignore_errors=True)
        os.replace(tmp, entry)
        tmp = None
        return True
    except OSError as e:  # a full disk, no permission, a concurrent writer's rename
        logger.warning("could not cache %s in %s: %s", what, entry, e)
        return False
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _write_meta(path: Path, config: Any, tokenizer: Any) -> None:
    entry = _meta_entry(path)
    if entry is None:
        return

    def fill(tmp: Path) -> None:
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / META_MARKER).write_text(json.dumps(_meta_key(path), sort_keys=True))

    publish_entry(entry, fill, f"{path.name}'s metadata")


@dataclass(frozen=True, slots=True)
class TensorView:
    """One tensor of the file, as stored."""

    name: str
    qtype: int  # GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order: (rows, cols) for a matrix, cols = ne0 (the reduction dim)
    data: np.ndarray  # the mapping's bytes: uint8 [rows, row_bytes] for a block type, else [rows, cols] floats
    offset: int  # byte offset of `data` in the file
    nbytes: int


class GGUFTensors:
    """The tensors of a memory-mapped GGUF file by name, and the architecture it declares (the
    header read by `gguf_read`: gguf-py's reader parses every vocabulary string into numpy views,
    seconds for a large vocabulary)."""

    def __init__(self, path: Path) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        from batchserve.model.gguf_read import read_gguf

        self.path = path
        try:
            contents = read_gguf(path)
            self.mapping = np.memmap(path, dtype=np.uint8, mode="r")
        except (ValueError, OSError, IndexError, KeyError, UnicodeDecodeError, struct.error) as e:
            raise ValueError(f"{path} is not a GGUF file this reader can read: {e}") from None
        arch = contents.metadata.get("general.architecture")
        self.architecture = str(arch.value) if arch is not None else ""
        self.tensors: dict[str, TensorView] = {}
        floats = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}
        for t in contents.tensors:
            cols, rows = t.ne[0], int(np.prod(t.ne[1:], dtype=np.int64))
            block, size = GGML_QUANT_SIZES[t.qtype]
            nbytes = rows * (cols // block) * size
            if t.offset + nbytes > self.mapping.shape[0]:
                raise ValueError(f"{path} is truncated: tensor {t.name} ends past the file")
            raw = self.mapping[t.offset : t.offset + nbytes]
            dtype = floats.get(t.qtype)
            data = raw.view(dtype).reshape(rows, cols) if dtype is not None else raw.reshape(rows, -1)
            shape = (rows, cols) if len(t.ne) > 1 else (cols,)
            self.tensors[t.name] = TensorView(t.name, int(t.qtype), shape, data if len(t.ne) > 1 else data.reshape(-1),
                                              t.offset, nbytes)  # fmt: skip

    def get(self, name: str) -> TensorView | None:
        return self.tensors.get(name)

    def __getitem__(self, name: str) -> TensorView:
        view = self.tensors.get(name)
        if view is None:
            raise ValueError(f"{self.path.name} has no tensor {name}")
        return view

    def release(self, view: TensorView) -> None:
        """Drop `view`'s pages from this process (they stay in the page cache; a later read maps
        them again): called once a layer holds its own packed copy."""
        raw = getattr(self.mapping, "_mmap", None)
        if raw is None or not hasattr(raw, "madvise"):
            return
        page = mmap.PAGESIZE
        start = view.offset // page * page
        end = view.offset + view.nbytes
        try:
            raw.madvise(mmap.MADV_DONTNEED, start, end - start)
        except (OSError, ValueError):  # only a hint: a platform without it keeps the pages
            pass


FLOAT_TYPES = (0, 1, 30)  # F32, F16, BF16: read as floats (norms, biases), never as blocks


def type_name(qtype: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(qtype).name
    except ValueError:
        return f"type {qtype}"


def dequantized(view: TensorView) -> np.ndarray:
    """The tensor as float32 [rows, cols] (gguf-py's dequantizers: llama.cpp's formulas)."""
    from gguf import dequantize

    return np.asarray(dequantize(view.data, view.qtype), dtype=np.float32).reshape(view.shape)


class GGUFRefused(ValueError):
    """The file cannot be served from its own blocks here (another load may serve it); the
    message says why."""

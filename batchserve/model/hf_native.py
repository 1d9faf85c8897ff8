"""The native model built straight from an HF directory's safetensors on the CPU, for bfloat16
products: each tensor is read from the memory-mapped file, packed for our bfloat16 kernel and
dropped, so a load holds the packed weights plus one tensor, never a float32 model (transformers'
load of a bfloat16 checkpoint in float32 takes twice the file, then the packing a third copy).

The products, norms and embedding values are those the transformers path gives with
`cpu_weights=bfloat16` (the same packed bfloat16 weights, the same float32 norms; the embedding
kept in the file's own dtype and widened exactly on lookup): the same bits, a third of the memory."""

from __future__ import annotations

import json
import logging
import mmap
import struct
import time
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from batchserve.model.family import stored_norm
from batchserve.model.llama import PACKED_MODULES, NativeLlamaForCausalLM, product_out_dtype, supports

logger = logging.getLogger("batchserve")


class FileEmbedding(nn.Module):
    """The token embedding in the checkpoint's own dtype (bfloat16 or float16: half float32's
    bytes), widened to float32 on lookup, which is exact."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight)  # [V, H]
        self.num_embeddings, self.embedding_dim = weight.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids].float()  # [T, H]

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {str(self.weight.dtype).removeprefix('torch.')}"


def safetensors_files(directory: Path) -> list[Path]:
    """The checkpoint's safetensors files (sharded by an index, or one), [] where it has none."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / n for n in names]
    single = directory / "model.safetensors"
    return [single] if single.is_file() else []


def hf_direct_refusal(directory: Path, config: Any) -> str | None:
    """Why this directory is not read tensor by tensor into bfloat16 products; None where it is."""
    from batchserve.model.bf16 import our_bf16_here

    if not safetensors_files(directory):
        return "no safetensors files in the directory"
    why = supports(config)
    if why is not None:
        return f"the native forward does not support {why}"
    if config.model_type in TRANSFORMERS_READ:
        return f"{config.model_type} checkpoints (MXFP4 experts) are read through transformers"
    if not our_bf16_here():
        return "our bfloat16 kernel does not run invariantly here"
    return None


TRANSFORMERS_READ = ("gpt_oss",)  # checkpoints whose tensors are not ours as stored: transformers reads them
FUSED_IN_FILE = ("qkv_proj", "gate_up_proj")  # products a checkpoint may store merged as ours are (Phi-3)
# Products a checkpoint stores whole, as ours are: the attention's output, an MLP's (or an expert's)
# down, the head.
WHOLE_PRODUCTS = ("o_proj", "down_proj", "lm_head")
# Mixtral's checkpoint names for the modules ours names as the other routed-expert families do.
RENAMED = ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj."))


def our_name(key: str) -> str:
    """A checkpoint key -> our parameter's name (without `model.`; Mixtral's experts renamed)."""
    name = key.removeprefix("model.")
    for old, new in RENAMED:
        name = name.replace(old, new)
    return name


SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


class SafetensorsMap:
    """One safetensors file memory-mapped: its tensors as views of the map (no copy), and each
    tensor's pages dropped from this process once a layer holds its own packed copy (`release`),
    so a load's resident memory is the packed weights plus a product's tensors, not the file too."""

    def __init__(self, path: Path) -> None:
        with open(path, "rb") as f:
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        size = struct.unpack_from("<Q", self.map, 0)[0]
        header = json.loads(self.map[8 : 8 + size])
        header.pop("__metadata__", None)
        self.base, self.entries = 8 + size, header

    def keys(self) -> list[str]:
        return list(self.entries)

    def get(self, key: str) -> torch.Tensor:
        entry = self.entries[key]
        dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ValueError(f"tensor {key} is {entry['dtype']}: read as bfloat16 products are float tensors only")
        start, end = entry["data_offsets"]
        if end == start:
            return torch.empty(entry["shape"], dtype=dtype)
        with warnings.catch_warnings():  # a read-only map: nothing here writes into it
            warnings.simplefilter("ignore")
            flat = torch.frombuffer(memoryview(self.map)[self.base + start : self.base + end], dtype=dtype)
        return flat.view(entry["shape"])

    def release(self, key: str) -> None:
        start, end = (self.base + o for o in self.entries[key]["data_offsets"])
        page = mmap.PAGESIZE
        try:
            self.map.madvise(mmap.MADV_DONTNEED, start // page * page, end - start // page * page)
        except (OSError, ValueError, AttributeError):  # only a hint
            pass


def load_hf_native(directory: Path) -> tuple[NativeLlamaForCausalLM, Any]:
    """(native model with bfloat16 products on our kernel, tokenizer) from an HF directory."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from batchserve.model.bf16 import KernelBf16Linear
    from batchserve.model.family import local_rotary_for, rotary_for
    from batchserve.model.layer_kernels import TORCH_LAYERS

    t0 = time.perf_counter()
    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    why = hf_direct_refusal(directory, config)
    if why is not None:
        raise ValueError(why)
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    with torch.device("meta"):
        model = NativeLlamaForCausalLM(config, torch.empty(0), 1.0, TORCH_LAYERS)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    merged: dict[str, dict[int, torch.Tensor]] = {}  # a merged product's parts, until all are read
    biases: dict[str, dict[int, torch.Tensor]] = {}
    for file in safetensors_files(directory):
        f = SafetensorsMap(file)
        waiting: dict[str, list[str]] = {}  # a merged product's keys, released once it is packed
        for key in f.keys():
            name = our_name(key)
            if name == "lm_head.weight" and tied:
                continue
            tensor = f.get(key)
            module, _, leaf = name.rpartition(".")
            parent, _, proj = module.rpartition(".")
            if proj in PACKED_MODULES:
                target, part = PACKED_MODULES[proj]
                (merged if leaf == "weight" else biases).setdefault(f"{parent}.{target}", {})[part] = tensor
                waiting.setdefault(f"{parent}.{target}", []).append(key)
                if _pack_ready(model, f"{parent}.{target}", merged, biases, KernelBf16Linear):
                    for done in waiting.pop(f"{parent}.{target}"):
                        f.release(done)
                continue
            _read_single(model, f, key, tensor, tied)
            del tensor
            f.release(key)
    model.rotary, model.rotary_local = rotary_for(config, None), local_rotary_for(config)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left or merged:
        raise ValueError(f"the checkpoint has no weights for {(left or sorted(merged))[:4]}")
    model.cpu_weights = "bfloat16"
    model.cpu_weights_reason = "bfloat16 products on our kernel, read tensor by tensor from the safetensors files"
    model.batch_invariant_linears = True  # our bfloat16 kernel passed its check (hf_direct_refusal)
    model.generation_config = GenerationConfig.from_model_config(config)
    config._name_or_path = str(directory)
    logger.info("read %s in %.1f s: %s", directory, time.perf_counter() - t0, model.cpu_weights_reason)
    return model.eval(), tokenizer


def _read_single(model: NativeLlamaForCausalLM, f: SafetensorsMap, key: str, tensor: torch.Tensor, tied: bool) -> None:
    """A tensor that is not part of a product we merge: the embedding, a product the file stores
    whole (o, down, the head; Phi's merged q|k|v and gate|up), or a norm."""
    from batchserve.model.bf16 import KernelBf16Linear

    name = our_name(key)
    module, _, leaf = name.rpartition(".")
    if name == "embed_tokens.weight":
        model.embed_tokens = FileEmbedding(tensor.clone())  # its own copy: the map's pages go
        if tied:
            model.lm_head = _bf16(KernelBf16Linear, tensor, None, "lm_head")
    elif leaf == "weight" and module.endswith(FUSED_IN_FILE):  # Phi's q|k|v and gate|up: already one
        sizes = model.get_submodule(module).sizes
        _set(model, module, _bf16(KernelBf16Linear, tensor, None, module, sizes))
    elif leaf == "weight" and module.endswith(WHOLE_PRODUCTS):
        bias_key = key.removesuffix("weight") + "bias"
        bias = f.get(bias_key) if bias_key in f.entries else None
        _set(model, module, _bf16(KernelBf16Linear, tensor, bias, module))
    elif not (leaf == "bias" and module.endswith(WHOLE_PRODUCTS)):  # a bias: read with its weight
        norm = stored_norm(model.config, name, tensor.float()).clone()  # Gemma's (1 + w) folded in
        _set(model, name, nn.Parameter(norm, requires_grad=False))


def _bf16(layer_class: type, weight: torch.Tensor, bias: torch.Tensor | None, name: str,
          sizes: tuple[int, ...] | None = None) -> nn.Module:  # fmt: skip
    out, inp = weight.shape
    linear = SimpleNamespace(in_features=inp, out_features=out, weight=weight, bias=bias, sizes=sizes or (out,))
    return layer_class(linear, product_out_dtype(name))


def _pack_ready(
    model: nn.Module,
    target: str,
    merged: dict[str, dict[int, torch.Tensor]],
    biases: dict[str, dict[int, torch.Tensor]],
    layer_class: type,
) -> bool:
    """Pack a merged product (q|k|v, gate|up) once every part's weight has been read; whether it was."""
    parts = merged.get(target, {})
    wanted = len(model.get_submodule(target).sizes)
    has_bias = getattr(model.get_submodule(target), "bias", None) is not None
    if len(parts) < wanted or (has_bias and len(biases.get(target, {})) < wanted):
        return False
    weight = torch.cat([parts[i] for i in range(wanted)])  # [sum of parts, K] in the file's dtype
    bias = torch.cat([biases[target][i] for i in range(wanted)]) if has_bias else None
    sizes = tuple(parts[i].shape[0] for i in range(wanted))
    _set(model, target, _bf16(layer_class, weight, bias, target, sizes))
    del merged[target]
    biases.pop(target, None)
    return True


def _set(model: nn.Module, name: str, value: nn.Module | nn.Parameter) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, value)

"""The model the engine runs, read the cheapest way its source allows: a GGUF file straight from
its blocks (`gguf_native`), an HF directory tensor by tensor into bfloat16 products
(`hf_native`), else transformers' load (`loader.load_model`), with a log line saying why."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from batchserve.model.loader import load_model, resolve_device_dtype, resolve_model_path

logger = logging.getLogger("batchserve")


def gguf_direct_refusal(path: str | os.PathLike[str] | None, model_config: Any) -> str | None:
    """Why the engine's model is not read straight from its GGUF file's blocks (`gguf_native`);
    None where it is: a GGUF file, on the CPU, float32 activations, the native forward, and
    `cpu_weights` auto or gguf. (The checks on the file itself come when it is opened.)"""
    _, gguf_file = resolve_model_path(path)
    mc = model_config
    if gguf_file is None:
        return "the model is a directory, not a GGUF file"
    device, dtype = resolve_device_dtype(mc.device, mc.dtype)
    if torch.device(device).type != "cpu":
        return f"blocks are read on the CPU; the model runs on {device}"
    if dtype != "float32" or mc.model_impl == "transformers" or mc.cpu_weights not in ("auto", "gguf"):
        return f"dtype={mc.dtype}, model_impl={mc.model_impl}, cpu_weights={mc.cpu_weights} were asked for"
    if mc.cpu_linear == "torch":
        return "cpu_linear=torch was asked for"
    return None


def load_engine_model(model_config: Any, kv_bytes: Callable[[Any], int] | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) as the engine runs them: a GGUF file's layers over its own blocks where
    `gguf_direct_refusal` allows (a file our kernels cannot read falls back to transformers' load,
    with a log line saying why, unless cpu_weights=gguf insisted), else `load_model`. `kv_bytes`:
    the KV pool's bytes for a model config (what must fit beside the weights)."""
    from batchserve.model.gguf_native import GGUFRefused, load_gguf_native

    mc = model_config
    directory, gguf_file = resolve_model_path(mc.path)
    if gguf_file is None and mc.cpu_weights != "gguf":
        return _load_directory(directory, mc)
    why = gguf_direct_refusal(mc.path, mc)
    if why is None:
        try:
            return load_gguf_native(directory / str(gguf_file), kv_bytes)
        except GGUFRefused as e:
            if mc.cpu_weights == "gguf":
                raise ValueError(f"cpu_weights=gguf: {e}") from None
            logger.warning("reading %s through transformers instead of its own blocks: %s", gguf_file, e)
    elif mc.cpu_weights == "gguf":
        raise ValueError(f"cpu_weights=gguf reads a GGUF file's blocks on the CPU: {why}")
    check_conversion_fits(directory / str(gguf_file), mc, kv_bytes)
    return load_model(mc.path, mc.dtype, mc.device)


def check_conversion_fits(path: Path, mc: Any, kv_bytes: Callable[[Any], int] | None) -> None:
    """Raise GGUFTooLarge where transformers' load of the GGUF at `path` (every weight dequantized to
    `dtype`, twice at its peak: the file's dequantized arrays and the model) and the KV pool do not
    fit in the memory available, with the bytes it needs (on the CPU; a device holds its own)."""
    from batchserve.model.gguf_file import GGUFTensors
    from batchserve.model.gguf_memory import MARGIN_BYTES, GGUFTooLarge, available_bytes

    device, dtype = resolve_device_dtype(mc.device, mc.dtype)
    if torch.device(device).type != "cpu":
        return
    values = sum(int(np.prod(v.shape)) for v in GGUFTensors(path).tensors.values())
    width = 4 if dtype == "float32" else 2
    need, have = 2 * width * values + MARGIN_BYTES, available_bytes()
    if kv_bytes is not None:
        from transformers import AutoConfig

        need += kv_bytes(AutoConfig.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True))
    if have is not None and need > have:
        raise GGUFTooLarge(
            f"{path.name} is not read from its own blocks here, and transformers' load of it dequantizes every"
            f" weight to {dtype}: it needs {need:,} bytes ({need / 2**30:.1f} GiB with the KV pool) and {have:,}"
            " are available; use a smaller file, or one of the types and architectures read from their blocks"
        )


def _load_directory(directory: Path, mc: Any) -> tuple[Any, Any]:
    """An HF directory: read tensor by tensor into bfloat16 products where the engine would run
    bfloat16 products on the CPU (`cpu_weights` bfloat16, or auto where it chooses them), else
    transformers' load."""
    from transformers import AutoConfig

    from batchserve.model import cpu_weights_choice
    from batchserve.model.hf_native import hf_direct_refusal, load_hf_native

    device, dtype = resolve_device_dtype(mc.device, mc.dtype)
    on_cpu = torch.device(device).type == "cpu"
    weights = mc.cpu_weights if mc.cpu_weights != "auto" else cpu_weights_choice(on_cpu, str(directory)).weights
    if on_cpu and dtype == "float32" and mc.model_impl != "transformers" and weights == "bfloat16":
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
        why = hf_direct_refusal(directory, config) if mc.cpu_linear != "torch" else "cpu_linear=torch was asked for"
        if why is None:
            return load_hf_native(directory)
        logger.info("loading %s through transformers: %s", directory, why)
    return load_model(directory, mc.dtype, mc.device)

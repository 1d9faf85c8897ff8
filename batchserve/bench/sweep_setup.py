"""What a bench sweep settles before its first run: the optional peers it can run, its servers, its run count."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tqdm import tqdm

from batchserve.bench import servers
from batchserve.bench.methods import LLAMA_SERVER, SERVED, SINGLE, batchserve_method
from batchserve.bench.peers import llamacpp_gguf
from batchserve.bench.served import ServedPeers


def optional_peers(
    methods: list[str], model_path: str | None
) -> tuple[list[str], Path | None, tuple[str, Path] | None, str]:
    """(the methods that can run, llama.cpp's GGUF, llama-server's binary and GGUF, why any
    optional peer is skipped): the sweep goes on without them, and the report says why."""
    gguf, skipped = llamacpp_gguf(model_path) if "llamacpp" in methods else (None, "")
    if skipped:
        methods = [m for m in methods if m != "llamacpp"]
    peer, why = servers.llama_server_peer(model_path) if set(LLAMA_SERVER) & set(methods) else (None, "")
    if why:
        methods = [m for m in methods if m not in LLAMA_SERVER]
    skipped = "; ".join(filter(None, (skipped, why)))
    if skipped:
        tqdm.write(skipped)
    return methods, gguf, peer, skipped


def served_peers(
    methods: list[str],
    model_path: str | None,
    engine_model: Any,
    batch_sizes: list[int],
    logs: Path,
    llama_server: tuple[str, Path] | None,
) -> ServedPeers | None:
    """The served rows' servers (None: no served method): ours with at least make serve's 16
    seats, on the weights it runs here."""
    from batchserve.bench.host import served_weights

    if not set(SERVED + LLAMA_SERVER) & set(methods):
        return None
    seats = max(16, *batch_sizes)
    on_cpu = engine_model is None or engine_model.device.type == "cpu"
    weights, _ = served_weights(on_cpu, model_path)
    return ServedPeers(model_path, weights, seats, logs, llama_server)


def runs_per_dataset(
    methods: list[str], batch_sizes: list[int], rates: list[float], repeats: int, llamacpp_rounds: bool
) -> int:
    """Runs of one dataset, for the progress bar."""
    return (
        sum(m in SINGLE for m in methods)
        + (repeats - 1) * llamacpp_rounds
        + len(batch_sizes) * sum(m not in SINGLE for m in methods) * repeats
        + len(rates) * sum(batchserve_method(m) is not None for m in methods) * repeats
    )


def reference_model(methods: list[str], model_path: str | None, dtype: str) -> tuple[Any, Any]:
    """(HF's model in process, the tokenizer); no model where every method is served: the servers
    load it, and transformers' float32 copy of an 8B file would not fit beside them."""
    from batchserve.model import loader

    if set(methods) <= set(SERVED + LLAMA_SERVER):
        return None, loader.load_tokenizer(model_path)
    return loader.load_model(model_path, dtype)

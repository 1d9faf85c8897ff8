"""Run the peers, timed per request: HF `generate`, `generate_batch`, and llama.cpp.

`generate` runs one prompt at a time (plain, with a static cache, or with prompt lookup);
`generate_batch` is transformers' continuous batching; `llamacpp` is llama.cpp through the
optional llama-cpp-python, one prompt at a time on the engine's own GGUF file. Each runner
returns (outputs, seconds, TTFTs, TPOTs): the generated token ids per prompt, the run's wall
time, and every request's time to first token and mean time per later token.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from batchserve import heap

PeerRun = tuple[list[list[int]], float, list[float], list[float]]
LLAMACPP_MISSING = "llamacpp: not installed (pip install 'batchserve[llamacpp]')"


class _FirstTokenTimer:
    """A transformers streamer that notes when the first generated token arrives."""

    def __init__(self) -> None:
        self.calls = 0
        self.first: float | None = None

    def put(self, value: Any) -> None:
        self.calls += 1
        if self.calls == 2 and self.first is None:  # call 1 is the prompt
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def static_cache_kwargs(model: Any, prompts: list[list[int]], max_new: int) -> dict[str, Any]:
    """HF `generate` at its fastest: a static KV cache sized once for every prompt (so shapes
    recur) and a compiled forward (CUDA graphs on a GPU, inductor on a CPU)."""
    from transformers import CompileConfig

    cuda = model.device.type == "cuda"
    config = CompileConfig(fullgraph=True, mode="reduce-overhead" if cuda else "default")
    config._compile_all_devices = True  # transformers compiles on CUDA only unless told
    return {
        "cache_implementation": "static",
        "max_cache_len": max(map(len, prompts)) + max_new,
        "compile_config": config,
    }


def _compile_static(model: Any, prompt: list[int], max_new: int, kwargs: dict[str, Any], desc: str) -> None:
    """Compile (and capture) the static-cache forward outside the timed run."""
    t0 = time.perf_counter()
    with torch.no_grad():
        x = torch.tensor([prompt], device=model.device)
        model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new, **kwargs)
    tqdm.write(f"{desc}: compiled in {time.perf_counter() - t0:.1f} s")


@heap.settled()  # as our engine's runs: no full collections over the loaded model
def run_hf(
    model: Any,
    prompts: list[list[int]],
    max_new: int,
    eos: int,
    lookup: int | None,
    desc: str,
    static: bool = False,
) -> PeerRun:
    """HF `generate`, greedy, one prompt at a time; `lookup`: prompt lookup decoding with that
    many tokens; `static`: a static cache and a compiled forward (`static_cache_kwargs`)."""
    outputs, ttfts, tpots = [], [], []
    kwargs: dict[str, Any] = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    if static:
        kwargs.update(static_cache_kwargs(model, prompts, max_new))
        _compile_static(model, prompts[0], max_new, kwargs, desc)
    t0 = time.perf_counter()
    for ids in tqdm(prompts, desc=desc, leave=False):
        x = torch.tensor([ids], device=model.device)
        timer = _FirstTokenTimer()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=max_new,
                pad_token_id=eos,
                streamer=timer,
                **kwargs,
            )
        end = time.perf_counter()
        toks = out[0, len(ids) :].tolist()
        outputs.append(toks)
        first = timer.first or end
        ttfts.append(first - start)
        if len(toks) > 1:
            tpots.append((end - first) / (len(toks) - 1))
    return outputs, time.perf_counter() - t0, ttfts, tpots


HF_BATCH_TOKENS = 512  # tokens per step: our engine's default `max_num_batched_tokens`


@heap.settled()
def run_hf_batch(model: Any, prompts: list[list[int]], max_new: int, b: int) -> PeerRun:
    """HF `generate_batch`, greedy, with at most `b` requests per batch. Its KV pool is sized to
    the workload (the b longest requests) and its step to our engine's default token budget: by
    default it sizes both to the machine's free memory and warms up at that size, about 16 s per
    call on a 24 GiB machine, which the timing would count against it."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    gen = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=model.generation_config.eos_token_id)
    page = ContinuousBatchingConfig().page_size
    pages = sorted((-(-(len(p) + max_new) // page) for p in prompts), reverse=True)
    cb = ContinuousBatchingConfig(
        max_requests_per_batch=b, num_blocks=sum(pages[:b]) + b, max_batch_tokens=HF_BATCH_TOKENS
    )
    t0 = time.perf_counter()
    results = model.generate_batch(
        prompts, generation_config=gen, continuous_batching_config=cb, record_timestamps=True, progress_bar=False
    )
    seconds = time.perf_counter() - t0
    outputs, ttfts, tpots = [], [], []
    for r in results.values():
        outputs.append(list(r.generated_tokens))
        ts = r.timestamps or []
        started = r.lifespan[0] if r.lifespan[0] > 0 else r.created_time
        if ts:
            ttfts.append(ts[0] - started)
            if len(ts) > 1:
                tpots.append((ts[-1] - ts[0]) / (len(ts) - 1))
    return outputs, seconds, ttfts, tpots


def llamacpp_gguf(model_path: str | None) -> tuple[Path | None, str]:
    """The GGUF file the engine loads, for llama.cpp to load too, or (None, why the
    `llamacpp` peer is skipped): llama-cpp-python is optional, and a model directory has no GGUF."""
    from batchserve.model.loader import resolve_model_path

    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return None, LLAMACPP_MISSING
    except Exception as e:  # installed but broken (its shared library fails to load): say so, go on
        return None, f"llamacpp: skipped, llama_cpp does not import ({e})"
    directory, name = resolve_model_path(model_path)
    if name is None:
        return None, f"llamacpp: skipped, {directory} is not a GGUF model (llama.cpp runs GGUF files only)"
    return directory / name, ""


def load_llamacpp(gguf: Path, prompts: list[list[int]], max_new: int) -> Any:
    """llama.cpp on the same GGUF with the bench's thread count (for prompts too: its own
    default there is every core), a context that holds the longest prompt and its output,
    and all layers on the GPU where torch has one (a CPU-only build ignores that)."""
    from llama_cpp import Llama

    threads = torch.get_num_threads()
    return Llama(
        model_path=str(gguf),
        n_ctx=max(map(len, prompts)) + max_new,
        n_threads=threads,
        n_threads_batch=threads,
        n_batch=512,
        n_gpu_layers=-1 if torch.cuda.is_available() else 0,
        logits_all=False,
        verbose=False,
    )


@heap.settled()
def run_llamacpp(llm: Any, prompts: list[list[int]], max_new: int, stop: Collection[int], desc: str) -> PeerRun:
    """llama.cpp greedy, one prompt at a time (llama-cpp-python serves one sequence), fed the
    engine tokenizer's ids and stopped at the engine's end-of-sequence ids or `max_new` tokens."""
    outputs, ttfts, tpots = [], [], []
    t0 = time.perf_counter()
    for ids in tqdm(prompts, desc=desc, leave=False):
        start = time.perf_counter()
        first: float | None = None
        toks: list[int] = []
        llm.reset()  # no KV reuse from the previous prompt: the HF peers start every prompt afresh
        # temp 0 is llama.cpp's greedy sampler; the other settings would only filter its argmax
        for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            if first is None:
                first = time.perf_counter()
            toks.append(tok)  # an end-of-sequence token counts, as it does for HF and the engine
            if tok in stop or len(toks) == max_new:  # stop before the generator evaluates it
                break
        end = time.perf_counter()
        outputs.append(toks)
        ttfts.append((first or end) - start)
        if len(toks) > 1:
            tpots.append((end - (first or end)) / (len(toks) - 1))
    return outputs, time.perf_counter() - t0, ttfts, tpots

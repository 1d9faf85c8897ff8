"""Run the peers, timed per request: HF `generate`, `generate_batch`, and llama.cpp.

`generate` runs one prompt at a time (plain, with a static cache, or with prompt lookup);
`generate_batch` is transformers' continuous batching; `llamacpp` is llama.cpp through the
optional llama-cpp-python, one prompt at a time on the engine's own GGUF file (in a child
process: `llamacpp_child.py` runs `run_llamacpp` there). Each runner returns a `PeerRun`: the
generated token ids per prompt, the run's wall time, every request's time to first token and
decode-only time per later token, and where recorded, when each token arrived; a compiled
`hf-static` run also the proof that it compiled, without which it fails (`compiled.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from batchserve import heap
from batchserve.bench.compiled import (
    CompileStats,
    PeerNotCompiled,
    check_compiled,
    count_compiled_calls,
    watch_compiles,
)
from batchserve.bench.methods import Row, make_row

LLAMACPP_MISSING = "llamacpp: not installed (pip install 'batchserve[llamacpp]')"


@dataclass(slots=True)
class PeerRun:
    """One peer run. It unpacks as the (outputs, seconds, ttfts, tpots) tuple the runners
    returned before token times were recorded."""

    outputs: list[list[int]]  # the generated token ids, per prompt
    seconds: float  # the run's wall time
    ttfts: list[float]  # per request: time to first token
    tpots: list[float]  # per request with 2+ tokens: seconds from its first token to its last / later tokens
    # per request: when each generated token arrived, in seconds from the request's start (None: not recorded)
    token_times: list[list[float]] | None = None
    compile: CompileStats | None = None  # a compiled peer's: what torch.compile did (bench/compiled.py)

    def __iter__(self) -> Iterator[Any]:
        return iter((self.outputs, self.seconds, self.ttfts, self.tpots))

    @property
    def decode(self) -> list[tuple[int, float]] | None:
        """Per request with 2+ tokens: (tokens after the first, seconds from the first to the last)."""
        if self.token_times is None:
            return None
        return [(len(ts) - 1, ts[-1] - ts[0]) for ts in self.token_times if len(ts) > 1]


def peer_row(
    method: str, dataset: str, b: int, run: PeerRun, tokens_per_step: float | None, lossless: bool | None
) -> Row:
    """A peer's row from its run (a bare (outputs, seconds, ttfts, tpots) tuple, as test doubles
    return, has no token times: no decode-only rate); a compiled run's `compile` goes in as its
    `compile_stats`, and in a line as its `note` (the report lists notes)."""
    outs, secs, ttfts, tpots = run
    decode = getattr(run, "decode", None)
    row = make_row(method, dataset, b, outs, secs, ttfts, tpots, tokens_per_step, lossless, decode)
    if (stats := getattr(run, "compile", None)) is not None:
        row.compile_stats, row.note = asdict(stats), stats.note()
    return row


def _timed(outputs: list[list[int]], seconds: float, token_times: list[list[float]], walls: list[float]) -> PeerRun:
    """A run from each request's token times and wall time (its TTFT where no token came)."""
    ttfts = [ts[0] if ts else wall for ts, wall in zip(token_times, walls)]
    tpots = [(ts[-1] - ts[0]) / (len(ts) - 1) for ts in token_times if len(ts) > 1]
    return PeerRun(outputs, seconds, ttfts, tpots, token_times)


class _TokenTimer:
    """A transformers streamer that notes when each generated token arrives: `generate` puts the
    prompt first, then each step's tokens (prompt lookup puts its accepted drafts together: they
    share a time)."""

    def __init__(self) -> None:
        self.prompt_seen = False
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        now = time.perf_counter()
        if self.prompt_seen:
            self.times.extend([now] * value.numel())
        self.prompt_seen = True

    def end(self) -> None:
        pass


def static_cache_kwargs(
    model: Any, prompts: list[list[int]], max_new: int, compile_forward: bool = True
) -> dict[str, Any]:
    """HF `generate` at its fastest: one static KV cache for every prompt of the run and a
    compiled forward (CUDA graphs on a GPU, inductor on a CPU; `compile_forward=False`: eager).

    NOTE: `cache_implementation="static"` would have `generate` build a new StaticCache per
    call; under reduce-overhead the new K/V addresses make cudagraph trees record the decode
    graph again for every prompt, timed. This cache is built once, sized for the longest
    prompt and its output, on the model's device and dtype; each call starts from
    `cache.reset()`, which empties it in place, so its tensors keep their addresses."""
    from transformers import CompileConfig, StaticCache

    config = model.config.get_text_config(decoder=True)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    cache = StaticCache(config=model.config, max_cache_len=max(map(len, prompts)) + max_new)
    cache.early_initialization(batch_size=1, num_heads=heads, head_dim=head_dim, dtype=model.dtype, device=model.device)
    # transformers 5.24 names the argument `cache` (`past_key_values` is its deprecated alias)
    kwargs: dict[str, Any] = {"cache": cache}
    if not compile_forward:
        kwargs["disable_compile"] = True  # on CUDA `generate` compiles a static cache's forward unasked
        return kwargs
    cuda = model.device.type == "cuda"
    compile_config = CompileConfig(fullgraph=True, mode="reduce-overhead" if cuda else "default")
    compile_config._compile_all_devices = True  # transformers compiles on CUDA only unless told
    kwargs["compile_config"] = compile_config
    return kwargs


# one prompt's generation: (the tokens, when each arrived, the call's seconds)
Generate = Callable[[list[int]], tuple[list[int], list[float], float]]


def _warm_up(generate: Generate, prompts: list[list[int]], desc: str) -> None:
    """Run `generate` (the timed call itself: streamer, mask, cache) once per distinct prompt
    length, outside the timing. The static cache fixes the decode graph's shapes, so it compiles
    (and on CUDA is captured) in the first call; the prefill runs eager, and its first call at a
    new length pays for kernel selection and the allocator's growth. That is one untimed
    generation per length (about the run again where most prompts differ in length), and the
    timed run then holds no first-time cost."""
    t0 = time.perf_counter()
    lengths: dict[int, list[int]] = {}
    for ids in prompts:
        lengths.setdefault(len(ids), ids)
    for ids in lengths.values():
        generate(ids)
    tqdm.write(f"{desc}: warmed up on {len(lengths)} prompt lengths in {time.perf_counter() - t0:.1f} s")


def run_hf(
    model: Any,
    prompts: list[list[int]],
    max_new: int,
    eos: int,
    lookup: int | None,
    desc: str,
    static: bool = False,
    compile_forward: bool = True,
    max_decode_ms: float | None = None,
) -> PeerRun:
    """HF `generate`, greedy, one prompt at a time; `lookup`: prompt lookup decoding with that
    many tokens; `static`: one static cache for the run and, with `compile_forward`, a compiled
    forward (`static_cache_kwargs`), warmed up first on every prompt length (`_warm_up`) and proven
    compiled (`_compiled_run`; `max_decode_ms`: its limit on decode ms a token). Each token's arrival
    is timed: TTFT is the first's, TPOT runs from the first to the last."""
    kwargs: dict[str, Any] = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    cache = None
    if static:
        kwargs.update(static_cache_kwargs(model, prompts, max_new, compile_forward))
        cache = kwargs["cache"]

    def generate(ids: list[int]) -> tuple[list[int], list[float], float]:
        """(the tokens, when each arrived, the call's seconds), times from the call's start."""
        if cache is not None:
            cache.reset()
        x = torch.tensor([ids], device=model.device)
        timer = _TokenTimer()
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
        return out[0, len(ids) :].tolist(), [t - start for t in timer.times], end - start

    if static and compile_forward:
        return _compiled_run(model, generate, prompts, desc, max_decode_ms)
    if static:
        _warm_up(generate, prompts, desc)
    return _timed_run(generate, prompts, desc)


def _timed_run(generate: Generate, prompts: list[list[int]], desc: str) -> PeerRun:
    """`generate` over the prompts, timed."""
    with heap.settled():  # after the compile: its objects frozen too, no full collections while timed
        t0 = time.perf_counter()
        done = [generate(ids) for ids in tqdm(prompts, desc=desc, leave=False)]
        seconds = time.perf_counter() - t0
    return _timed([d[0] for d in done], seconds, [d[1] for d in done], [d[2] for d in done])


def _compiled_run(
    model: Any, generate: Generate, prompts: list[list[int]], desc: str, max_decode_ms: float | None
) -> PeerRun:
    """The warm-up and the timed run of a compiled static peer, watched (bench/compiled.py): a run
    that does not prove its forward compiled, or decodes slower than `max_decode_ms` a token,
    raises PeerNotCompiled. Its `compile` says what torch.compile did."""
    from torch._dynamo.exc import FailOnRecompileLimitHit, TorchDynamoException

    stats, compiled_before = CompileStats(), hasattr(model, "_compiled_call")
    try:
        with watch_compiles(stats):
            _warm_up(generate, prompts, desc)
        with watch_compiles(stats, timed=True), count_compiled_calls(model, stats):
            run = _timed_run(generate, prompts, desc)
    except (TorchDynamoException, FailOnRecompileLimitHit) as e:  # its message can run to pages
        raise PeerNotCompiled(f"hf-static: torch.compile failed ({type(e).__name__}: {str(e)[:300]})") from e
    run.compile = stats
    try:
        check_compiled(stats, run.decode, max_decode_ms, compiled_before)
    finally:
        tqdm.write(f"{desc}: {stats.note()}")
    return run


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
    outputs, ttfts, tpots, times = [], [], [], []
    for r in results.values():
        outputs.append(list(r.generated_tokens))
        started = r.lifespan[0] if r.lifespan[0] > 0 else r.created_time
        ts = [t - started for t in r.timestamps or []]
        times.append(ts)
        if ts:
            ttfts.append(ts[0])
            if len(ts) > 1:
                tpots.append((ts[-1] - ts[0]) / (len(ts) - 1))
    return PeerRun(outputs, seconds, ttfts, tpots, times)


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


@heap.settled()
def run_llamacpp(llm: Any, prompts: list[list[int]], max_new: int, stop: Collection[int], desc: str) -> PeerRun:
    """llama.cpp greedy, one prompt at a time (llama-cpp-python serves one sequence), fed the
    engine tokenizer's ids and stopped at the engine's end-of-sequence ids or `max_new` tokens."""
    outputs, times, walls = [], [], []
    t0 = time.perf_counter()
    for ids in tqdm(prompts, desc=desc, leave=False):
        start = time.perf_counter()
        toks: list[int] = []
        arrived: list[float] = []
        llm.reset()  # no KV reuse from the previous prompt: the HF peers start every prompt afresh
        # temp 0 is llama.cpp's greedy sampler; the other settings would only filter its argmax
        for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            arrived.append(time.perf_counter() - start)
            toks.append(tok)  # an end-of-sequence token counts, as it does for HF and the engine
            if tok in stop or len(toks) == max_new:  # stop before the generator evaluates it
                break
        walls.append(time.perf_counter() - start)
        outputs.append(toks)
        times.append(arrived)
    return _timed(outputs, time.perf_counter() - t0, times, walls)

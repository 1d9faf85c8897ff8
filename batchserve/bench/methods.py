"""The methods a bench run compares, and the row of results each (method, dataset, batch) gives.

Peers are HF transformers' own ways to generate and llama.cpp; the batchserve methods are engine
settings (drafter, trie layout, warm trie or not, fixed or adaptive decoding length, linear kernel).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

# Our server with make serve's settings over gRPC and HTTP, and with --draft none (the serving
# path's cost alone, against the in-process `none` on the same weights); llama.cpp's server on the
# same GGUF, plain and with its n-gram speculation (bench/served.py).
SERVED = ("served-grpc", "served-http", "served-grpc-none", "served-http-none")
LLAMA_SERVER = ("llama-server", "llama-server-ngram")
PEERS = ("hf", "hf-static", "hf-prompt-lookup", "hf-batch", "llamacpp", *SERVED, *LLAMA_SERVER)
# peers that run one prompt at a time (batch 1); llama-cpp-python serves one sequence
SINGLE = ("hf", "hf-static", "hf-prompt-lookup", "llamacpp")
FIXED_LENGTHS = (4, 16, 64)
ADAPTIVE_CAP = 64  # lookahead-adaptive: the per-request cap on draft tokens


@dataclass(frozen=True, slots=True)
class Method:
    draft: str
    layout: str
    warm: bool  # warm the trie on the dataset's dev outputs
    adaptive: bool = False
    decoding_length: int | None = None  # None: the run's --decoding-length
    cpu_linear: str = "auto"  # the server's default (oneDNN on a float32 CPU); "torch": torch's BLAS
    prefix_caching: bool = True  # the `+nocache` suffix turns it off
    jacobi: tuple[int, int, int] | None = None  # jacobi/hybrid (W, N, G); None: the engine's defaults
    model_impl: str = "auto"  # the server's default forward; "transformers": the HF model's own
    cpu_weights: str = "float32"  # "gguf": the file read from its blocks (lossless against its own `none-gguf`)
    predicted: bool = False  # the `+prediction` suffix: each request sends its sample's prediction
    logprobs: int | None = None  # the `+logprobs` suffix: each request asks for this many top logprobs

    @property
    def kernels(self) -> tuple[str, str, str]:
        """What a cost profile depends on beyond the model: the forward, its linear kernel, its weights."""
        return (self.model_impl, self.cpu_linear, self.cpu_weights)


BATCHSERVE = {
    "none": Method("none", "hierarchical", False),
    "llma": Method("llma", "single", False),
    "parallel": Method("lookahead", "parallel", True),
    "lookahead": Method("lookahead", "hierarchical", True),
    "lookahead-cold": Method("lookahead", "hierarchical", False),
    **{f"lookahead-{n}": Method("lookahead", "hierarchical", True, decoding_length=n) for n in FIXED_LENGTHS},
    "lookahead-adaptive": Method("lookahead", "hierarchical", True, adaptive=True, decoding_length=ADAPTIVE_CAP),
    # Lookahead Decoding's Jacobi window and n-gram pool, alone and merged with the (warm) trie.
    "jacobi": Method("jacobi", "hierarchical", False, adaptive=True, decoding_length=ADAPTIVE_CAP),
    "hybrid": Method("hybrid", "hierarchical", True, adaptive=True, decoding_length=ADAPTIVE_CAP),
    # A fixed decoding length runs the window every step, whatever it costs: what the pool can buy.
    **{f"jacobi-{n}": Method("jacobi", "hierarchical", False, decoding_length=n) for n in FIXED_LENGTHS},
    **{f"hybrid-{n}": Method("hybrid", "hierarchical", True, decoding_length=n) for n in FIXED_LENGTHS},
    # `none` and `lookahead-adaptive` on torch's own BLAS (--cpu-linear torch): what oneDNN brings.
    "none-blas": Method("none", "hierarchical", False, cpu_linear="torch"),
    "lookahead-adaptive-blas": Method(
        "lookahead", "hierarchical", True, adaptive=True, decoding_length=ADAPTIVE_CAP, cpu_linear="torch"
    ),
    # The same on the transformers model's forward (--model-impl transformers): what ours brings.
    "none-hf": Method("none", "hierarchical", False, model_impl="transformers"),
    "lookahead-adaptive-hf": Method(
        "lookahead", "hierarchical", True, adaptive=True, decoding_length=ADAPTIVE_CAP, model_impl="transformers"
    ),
    # ... and on ours where `auto` would not take it (on CUDA): what it brings there.
    "none-native": Method("none", "hierarchical", False, model_impl="native"),
    "lookahead-adaptive-native": Method(
        "lookahead", "hierarchical", True, adaptive=True, decoding_length=ADAPTIVE_CAP, model_impl="native"
    ),
}
METHODS = PEERS + tuple(BATCHSERVE)
# --cpu-weights -> the suffix of the methods that run on those weights: any method on our forward
# takes one (`none-gguf`: the GGUF file read from its blocks, as the server reads it, checked against
# its own `none-gguf`; `-bf16`: bfloat16 copies on our kernel or oneDNN's). A name without one runs
# float32 in `run`; the bench command first gives it the suffix of the weights `make serve` runs here
# (`as_served`), so `-f32` asks for float32 there.
WEIGHTS_SUFFIX = {"float32": "", "bfloat16": "-bf16", "gguf": "-gguf"}
F32 = "-f32"
SUFFIX_WEIGHTS = {"-bf16": "bfloat16", "-gguf": "gguf", F32: "float32"}
NOCACHE = "+nocache"  # any batchserve method with this suffix runs with prefix caching off
# ... with this one, each request sends its sample's expected output as a predicted output (code-edit:
# the code being edited; a JSONL line's "prediction"), as an OpenAI client does
PREDICTION = "+prediction"
# ... with this one, each request asks for its tokens' logprobs and LOGPROBS top alternatives (what
# reporting them costs: they never change a token, so the run is checked as the method's own)
LOGPROBS_SUFFIX = "+logprobs"
LOGPROBS = 5
SUFFIXES = (NOCACHE, PREDICTION, LOGPROBS_SUFFIX)


def _jacobi_shape(name: str) -> Method | None:
    """`jacobi-W-N` / `hybrid-W-N`: the method with that window, G = W (the paper's sweep)."""
    base, _, shape = name.partition("-")
    parts = shape.split("-")
    if base not in ("jacobi", "hybrid") or len(parts) != 2 or not all(p.isdigit() for p in parts):
        return None
    w, n = int(parts[0]), int(parts[1])
    if w < 1 or n < 2:
        return None
    return replace(BATCHSERVE[base], jacobi=(w, n, w))


def batchserve_method(name: str) -> Method | None:
    """The engine settings of a batchserve method name (None for a peer or an unknown name)."""
    base, nocache, predicted, logprobs = _suffixes(name)
    base, weights = _weights(base)
    m = BATCHSERVE.get(base) or _jacobi_shape(base)
    if m is None or (weights is not None and m.model_impl == "transformers"):  # HF's forward runs float32
        return None
    return replace(
        m,
        prefix_caching=m.prefix_caching and not nocache,
        predicted=predicted,
        logprobs=LOGPROBS if logprobs else None,
        cpu_weights=weights or m.cpu_weights,
    )


def _weights(base: str) -> tuple[str, str | None]:
    """(the method without its weights suffix, the weights it names or None)."""
    for suffix, weights in SUFFIX_WEIGHTS.items():
        if base.endswith(suffix):
            return base.removesuffix(suffix), weights
    return base, None


def as_served(methods: list[str], weights: str) -> list[str]:
    """The bench command's method names: a batchserve method that names no weights runs the
    weights `make serve` runs here (`weights`, cpu_weights=auto's choice), and says so in its
    name (`none` -> `none-gguf`); peers, and methods that name their weights or kernels (`-f32`,
    `-blas`, `-hf`, `-native`), stay as they are."""
    out = []
    for name in methods:
        m = batchserve_method(name)
        base, _, _, _ = _suffixes(name)
        explicit = _weights(base)[1] is not None or (m is not None and (m.model_impl, m.cpu_linear) != ("auto", "auto"))
        if m is None or explicit or weights == "float32":
            out.append(name)
        else:
            out.append(base + WEIGHTS_SUFFIX[weights] + name[len(base) :])
    return out


def _suffixes(name: str) -> tuple[str, bool, bool, bool]:
    """(base method, +nocache, +prediction, +logprobs): any of the suffixes, in any order."""
    base = name
    for _ in SUFFIXES:
        for suffix in SUFFIXES:
            base = base.removesuffix(suffix)
    tail = name[len(base) :]
    return base, NOCACHE in tail, PREDICTION in tail, LOGPROBS_SUFFIX in tail


def method_rank(name: str) -> tuple[int, bool, str]:
    """Where a method sorts in tables and legends: its base method's place (a `jacobi-W-N` after
    `jacobi`), a suffixed one after it."""
    base = _suffixes(name)[0]
    family = base if base in METHODS else base.partition("-")[0]
    return METHODS.index(family), base != name, name


# a method on other weights or kernels than float32 oneDNN
KERNEL_SUFFIXES = (*SUFFIX_WEIGHTS, "-blas", "-hf", "-native")


def none_of(method: str) -> str:
    """The plain decoding a method is compared with: `none` on the same weights and kernels."""
    return "none" + next((s for s in KERNEL_SUFFIXES if s in method), "")


def known_method(name: str) -> bool:
    return name in PEERS or batchserve_method(name) is not None


KEEP = ("fastest", "median")  # which of the repeated runs stands for a (method, batch)


@dataclass(slots=True)
class Row:
    method: str
    dataset: str
    batch_size: int
    num_prompts: int
    output_tokens: int
    seconds: float
    tokens_per_s: float
    tokens_per_step: float | None
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    lossless: bool | None
    mean_decoding_length: float | None = None  # draft tokens per request step
    cached_share: float | None = None  # prompt tokens from the prefix cache / prompt tokens (None: caching off)
    # batchserve rows: engine steps, and ms per step in each phase (StepPhases.NAMES) and in all ("wall")
    steps: int | None = None
    phase_ms: dict[str, float] | None = None
    overhead_ratio: float | None = None  # (step wall - forward) / step wall
    attention_share: float | None = None  # attention backend / step wall (CPU: where it is timed)
    decode_step_ms: float | None = None  # mean wall of the full-batch steps without a prompt chunk
    seated_tokens_per_s: float | None = None  # tokens/s over the steps with every seat taken
    served_step: dict[str, Any] | None = None  # the loop that serves per full step (`served_loop.py`)
    # a peer on other kernels (llamacpp: the GGUF's quantized weights): prompts whose output equals
    # HF greedy, which says how alike the outputs are, not losslessness
    reference_matches: int | None = None
    # an open-loop row: Poisson arrivals at this many requests per second, at most batch_size running
    request_rate: float | None = None
    # a +repeat workload: tokens per step of its second round (exact repeats of the first, run after it)
    repeat_tokens_per_step: float | None = None
    # a repeated (method, batch): every run's tokens/s in round order, the kept one among them
    run_tokens_per_s: list[float] | None = None
    # a served row: the in-process method it stands against (the same weights and drafts)
    versus: str | None = None
    # decode only: the tokens after each request's first / the seconds from its first token to its
    # last, over all requests (one request's streaming speed: at batch b the batch makes about b x)
    decode_tokens_per_s: float | None = None
    # On a GPU (judged against the same engine's `none`): how many prompts differ from it, every one
    # at a near-tie (`Divergence.near_tie`), with `lossless` None; `lossless` False: one beyond it.
    near_ties: int | None = None
    divergences: list[dict[str, float]] | None = None  # each differing prompt's `Divergence`, as a dict
    # a llama.cpp peer that ran on llama.cpp's fallback kernels: why (its default ones crashed here);
    # hf-static: what torch.compile did, as `compile_stats` (`CompileStats`, bench/compiled.py) in a line
    note: str | None = None
    compile_stats: dict[str, int] | None = None
    # a provisional row (more runs to come: a sweep cut at its limit keeps it): how many ran; None: final
    runs_done: int | None = None


def load_point(r: Row) -> str:
    """Where a row ran: its batch size (closed loop) or its request rate (open loop)."""
    return f"b={r.batch_size}" if r.request_rate is None else f"{r.request_rate:g} req/s"


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def expected_outputs(
    method: str,
    weights: str,
    hf: list[list[int]],
    own: dict[Any, list[list[int]]],
    key: Any,
    outputs: list[list[int]],
    constrained: bool = False,
    on_device: bool = False,
) -> list[list[int]] | None:
    """What a run's outputs must equal: HF greedy; for other weights (gguf, bfloat16), under a
    constraint HF does not apply, or on a GPU (`on_device`: HF's kernels round otherwise), the same
    weights' plain decoding (`none` / `none-gguf` / `none-bf16`, run first at that batch size; `own`,
    keyed by `key`); None: nothing to compare."""
    if weights == "float32" and not constrained and not on_device:
        return hf
    plain = "none" + WEIGHTS_SUFFIX[weights]
    if method == plain:
        own[(weights, key)] = outputs
        return None
    return own.get((weights, key))


def make_row(
    method: str,
    dataset: str,
    b: int,
    outputs: list[list[int]],
    seconds: float,
    ttfts: list[float],
    tpots: list[float],
    tokens_per_step: float | None,
    lossless: bool | None,
    decode: list[tuple[int, float]] | None = None,
) -> Row:
    """A row from one run's outputs and timings (percentiles and rates rounded for the report);
    `decode`: per request with 2+ tokens, (tokens after the first, seconds from the first to the last)."""
    n = sum(len(o) for o in outputs)
    row = Row(
        method,
        dataset,
        b,
        len(outputs),
        n,
        round(seconds, 3),
        round(n / seconds, 2),
        None if tokens_per_step is None else round(tokens_per_step, 3),
        round(percentile(ttfts, 0.5), 4),
        round(percentile(ttfts, 0.99), 4),
        round(percentile(tpots, 0.5), 4),
        round(percentile(tpots, 0.99), 4),
        lossless,
    )
    decode_seconds = sum(s for _, s in decode or ())
    if decode_seconds > 0:
        row.decode_tokens_per_s = round(sum(k for k, _ in decode or ()) / decode_seconds, 2)
    return row


def pick_run(runs: list[Row], keep: str) -> Row:
    """The run that stands for a (method, batch): the fastest, or the median by tokens/s
    (the lower middle one for an even count). The worst verdict of any run marks it: a mismatch,
    else near-ties."""
    by_speed = sorted(runs, key=lambda r: r.tokens_per_s)
    row = by_speed[-1] if keep == "fastest" else by_speed[(len(by_speed) - 1) // 2]
    worst = max(runs, key=_severity)
    if _severity(worst) > _severity(row):  # the verdict, and its details, of the worst run
        row = replace(row, lossless=worst.lossless, near_ties=worst.near_ties, divergences=worst.divergences)
    if len(runs) > 1:
        row = replace(row, run_tokens_per_s=[r.tokens_per_s for r in runs])
    return row


def provisional_rows(runs: Iterable[list[Row]], keep: str) -> list[Row]:
    """The rows repeated runs stand at before their last round: each the `keep` one so far."""
    return [replace(pick_run(rs, keep), runs_done=len(rs)) for rs in runs if rs]


def _severity(r: Row) -> int:
    """How bad a run's verdict is: identical or unchecked 0, near-ties 1, a mismatch 2."""
    return 2 if r.lossless is False else int(bool(r.near_ties))


def read_rows(paths: list[Path]) -> list[Row]:
    """The rows of bench runs' results.json files (a path may be a run's directory). Where two
    files hold the same point (dataset, method, batch, request rate), the later file's stands.
    A file that is missing or not a bench's results raises ValueError, naming it."""
    points: dict[tuple[str, str, int, float | None], Row] = {}
    names = {f.name for f in fields(Row)}
    for path in paths:
        file = path / "results.json" if path.is_dir() else path
        try:
            items = json.loads(file.read_text())
            if not isinstance(items, list):
                raise TypeError("not a list of rows")
            rows = [Row(**{k: v for k, v in item.items() if k in names}) for item in items]
            if any(not isinstance(r.batch_size, int) or not isinstance(r.tokens_per_s, int | float) for r in rows):
                raise TypeError("a row's batch_size or tokens_per_s is not a number")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, TypeError, AttributeError) as e:
            raise ValueError(f"{file}: not a bench results.json ({e})") from None
        for r in rows:
            points[(r.dataset, r.method, r.batch_size, r.request_rate)] = r
    return list(points.values())

"""`batchserve bench`: batchserve's drafters against real peers, one run, one machine.

Batch size b: b requests in flight (a closed loop). Every batchserve output is compared with HF
`generate` greedy (`lossless`). Writes DIR/results.json, DIR/report.md and DIR/throughput.png.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from batchserve.bench.datasets import REPEAT, Sample, load_samples, split, split_workload
from batchserve.bench.load import open_loop, open_loop_latencies, poisson_arrivals
from batchserve.bench.methods import KEEP, SINGLE, Method, Row, batchserve_method, expected_outputs, make_row, pick_run
from batchserve.bench.peers import llamacpp_gguf, load_llamacpp, run_hf, run_hf_batch, run_llamacpp
from batchserve.bench.report import plot, save_results, write_report
from batchserve.bench.simulate import encode
from batchserve.request import tokens_per_step
from batchserve.runner.build import eos_token_ids
from batchserve.scheduler import SchedulerOutput, StepPhases

if TYPE_CHECKING:
    from batchserve.scheduler.cost_profile import CostProfile


@dataclass(slots=True)
class PhaseTotals:
    """Sums of the engine's step phases over a run (a step listener)."""

    batch_size: int  # a full decode step runs this many requests
    steps: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys((*StepPhases.NAMES, "wall"), 0.0))
    attention: float | None = None  # seconds inside the attention backend, where it is timed
    decode_steps: int = 0  # full steps without a prompt chunk: one committed token per request
    decode_wall: float = 0.0

    def add(self, out: SchedulerOutput, phases: StepPhases) -> None:
        if not out.requests:
            return
        self.steps += 1
        for name, t in phases.items():
            self.seconds[name] += t
        self.seconds["wall"] += phases.wall
        if phases.attention is not None:
            self.attention = (self.attention or 0.0) + phases.attention
        if len(out.requests) == self.batch_size and all(len(r.token_ids) == 1 and r.sample for r in out.requests):
            self.decode_steps += 1
            self.decode_wall += phases.wall

    def apply(self, row: Row) -> None:
        row.steps = self.steps
        if self.steps:
            row.phase_ms = {k: round(v * 1e3 / self.steps, 3) for k, v in self.seconds.items()}
            wall = self.seconds["wall"]
            row.overhead_ratio = round((wall - self.seconds["forward"]) / wall, 4) if wall else None
            if self.attention is not None and wall:
                row.phase_ms["attention"] = round(self.attention * 1e3 / self.steps, 3)
                row.attention_share = round(self.attention / wall, 4)
        if self.decode_steps:
            row.decode_step_ms = round(self.decode_wall * 1e3 / self.decode_steps, 3)


@dataclass(slots=True)
class EngineRun:
    """What one batchserve run measured."""

    outputs: list[list[int]]
    seconds: float
    ttfts: list[float]
    tpots: list[float]
    tokens_per_step: float
    mean_len: float  # draft tokens per request step
    phases: PhaseTotals
    cached_share: float | None  # prompt tokens served from the prefix cache / prompt tokens


def run_batchserve(
    engine_model: Any,
    tokenizer: Any,
    prompts: list[list[int]],
    max_new: int,
    b: int,
    m: Method,
    warm: list[list[int]],
    decoding_length: int,
    cost_profile: CostProfile | None = None,
    earlier: list[list[int]] = (),  # type: ignore[assignment]
    arrivals: list[float] | None = None,
    max_num_batched_tokens: int | None = None,
) -> EngineRun:
    """One batchserve method at batch size b, on the server's default KV pool (a smaller one
    evicts the cached prefixes a workload shares). `earlier` prompts (a conversation's first
    turns) run first, unmeasured, on the same engine. With `arrivals` (seconds from the start,
    one per prompt) the load is an open loop (`load.open_loop`) with at most b running."""
    from batchserve import LLM, SamplingParams

    llm = LLM(
        draft=m.draft,
        draft_layout=m.layout,
        decoding_length=m.decoding_length or decoding_length,
        adaptive=m.adaptive,
        max_num_seqs=b,
        hf_model=engine_model,
        tokenizer=tokenizer,
        cost_profile=cost_profile,
        cpu_linear=m.cpu_linear,
        model_impl=m.model_impl,
        cpu_weights=m.cpu_weights,
        prefix_caching=m.prefix_caching,
        **({} if max_num_batched_tokens is None else {"max_num_batched_tokens": max_num_batched_tokens}),
        **(dict(zip(("window_size", "ngram_size", "guesses"), m.jacobi)) if m.jacobi else {}),
    )
    if m.warm:
        llm.engine.drafter.warm_up(warm)
    if earlier:  # the conversations so far reach the server first (one token each: their KV is what counts)
        llm.generate(earlier, SamplingParams(max_new_tokens=1))
    phases = PhaseTotals(b)
    llm.engine.step_listeners.append(phases.add)
    params = SamplingParams(max_new_tokens=max_new)
    if arrivals is not None:
        results, due, seconds = open_loop(llm, prompts, params, arrivals)
        ttfts, tpots = open_loop_latencies(results, due)
    else:
        t0 = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        ttfts = closed_loop_ttfts(results, b)
        tpots = [
            (r.finish_time - r.first_token_time) / (len(r.token_ids) - 1) for r in results if len(r.token_ids) > 1
        ]
    steps = sum(r.stats.steps for r in results)
    outputs = [r.token_ids for r in results]
    mean_len = sum(r.stats.draft_tokens_proposed for r in results) / max(1, steps)
    cached = sum(r.stats.cached_prompt_tokens for r in results) / max(1, sum(map(len, prompts)))
    tps = tokens_per_step(sum(len(o) for o in outputs), steps)
    return EngineRun(outputs, seconds, ttfts, tpots, tps, mean_len, phases, cached if m.prefix_caching else None)


def closed_loop_ttfts(results: list[Any], b: int) -> list[float]:
    """Time to first token of requests sent in order through b seats (a closed loop): the
    first b start together, each later one when a seat frees, at the (k - b)-th finish. Time
    it then waits for the engine to admit it (token budget, KV blocks) counts."""
    finishes = sorted(r.finish_time for r in results)
    return [
        r.first_token_time - (r.arrival_time if k < b else max(r.arrival_time, finishes[k - b]))
        for k, r in enumerate(results)
    ]


@dataclass(slots=True)
class Workload:
    """A dataset's measured prompts, the dev outputs that warm the trie, and the prompts sent
    earlier in each run, unmeasured (sharegpt-multiturn: each conversation's first turn and its
    reference reply)."""

    prompts: list[list[int]]
    warm: list[list[int]]
    earlier: list[list[int]] = field(default_factory=list)


def load_dataset(name: str, num_prompts: int, tokenizer: Any) -> Workload:
    """The first `num_prompts` test prompts of dataset `name` (`datasets.DATASETS`, or a JSONL
    file). `NAME+repeat`: the first half of them, then the same again (exact repeats, whose
    outputs the first round has put in the trie and the prefix cache)."""
    base = name.removesuffix(REPEAT)
    unique = -(-num_prompts // 2) if base != name else num_prompts
    samples = load_samples(base, max(400, 2 * unique))
    firsts: list[Sample] = []
    if base == "sharegpt-multiturn":  # (first turn, second turn) pairs
        firsts, samples = [p[0] for p in samples], [p[1] for p in samples]  # type: ignore[index]
    dev, test = split_workload(base, samples)
    warm = [e.output for e in encode(dev, tokenizer)]
    prompts = [e.prompt for e in encode(test[:unique], tokenizer)]
    earlier = [_conversation_so_far(s, tokenizer) for s in split(firsts)[1][:unique]]
    if base != name:
        prompts, earlier = (prompts + prompts)[:num_prompts], (earlier + earlier)[:num_prompts]
    return Workload(prompts, warm, earlier)


def _conversation_so_far(first: Sample, tokenizer: Any) -> list[int]:
    """A first turn and its reference reply, as a chat client's history stands before the
    second turn (rendered without a generation prompt: the second turn's prompt starts so)."""
    messages = [*first.messages(), {"role": "assistant", "content": first.reference}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    return list(tokenizer(text, add_special_tokens=False).input_ids)


@dataclass(slots=True)
class _Sweep:
    """What every run of one sweep shares: its settings, the models and the progress bar."""

    methods: list[str]
    max_new: int
    decoding_length: int
    repeats: int
    keep: str
    ref_model: Any
    engine_model: Any
    tokenizer: Any
    cost_profiles: dict[tuple[str, str], CostProfile]
    bar: Any
    gguf: Path | None = None  # the engine's GGUF file, for the llamacpp peer
    own_references: dict[tuple[str, int], list[list[int]]] = field(default_factory=dict)  # `none-q4`'s


def _cost_profiles(methods: list[str], engine_model: Any, tokenizer: Any) -> dict[tuple[str, str], CostProfile]:
    """The profiles the server would use (cached per device, dtype, model and kernels; measured if absent)."""
    cost_profiles = {}
    specs = [batchserve_method(m) for m in methods]
    for impl, cpu_linear, weights in {m.kernels for m in specs if m is not None and m.adaptive}:
        from batchserve import LLM

        kw = dict(cpu_linear=cpu_linear, model_impl=impl, cpu_weights=weights)
        probe = LLM(adaptive=True, hf_model=engine_model, tokenizer=tokenizer, **kw)
        cost_profiles[(impl, cpu_linear, weights)] = probe.engine.cost_profile
        del probe
    return cost_profiles


def _peer_rows(
    s: _Sweep, dataset: str, prompts: list[list[int]], num_prompts: int
) -> tuple[list[Row], list[list[int]]]:
    """The greedy reference for every prompt, and the rows of the peers that run at batch 1."""
    eos = s.tokenizer.eos_token_id
    first = prompts[:num_prompts]
    rows: list[Row] = []
    # The greedy reference; its first `num_prompts` are also the `hf` row.
    reference, secs, ttfts, tpots = run_hf(s.ref_model, first, s.max_new, eos, None, f"{dataset} hf")
    if "hf" in s.methods:
        rows.append(make_row("hf", dataset, 1, reference, secs, ttfts, tpots, 1.0, None))
        s.bar.update(1)
    if len(prompts) > num_prompts:
        rest = run_hf(s.ref_model, prompts[num_prompts:], s.max_new, eos, None, f"{dataset} reference")[0]
        reference = reference + rest
    if "hf-static" in s.methods:
        outs, secs, ttfts, tpots = run_hf(s.ref_model, first, s.max_new, eos, None, f"{dataset} hf-static", static=True)
        rows.append(make_row("hf-static", dataset, 1, outs, secs, ttfts, tpots, 1.0, outs == reference[:num_prompts]))
        s.bar.update(1)
    if "hf-prompt-lookup" in s.methods:
        outs, secs, ttfts, tpots = run_hf(s.ref_model, first, s.max_new, eos, 10, f"{dataset} hf-prompt-lookup")
        rows.append(make_row("hf-prompt-lookup", dataset, 1, outs, secs, ttfts, tpots, None, None))
        s.bar.update(1)
    if "llamacpp" in s.methods and s.gguf is not None:
        llm = load_llamacpp(s.gguf, first, s.max_new)
        stop = eos_token_ids(s.ref_model, s.tokenizer)  # the engine's own stop set
        outs, secs, ttfts, tpots = run_llamacpp(llm, first, s.max_new, stop, f"{dataset} llamacpp")
        rows.append(make_row("llamacpp", dataset, 1, outs, secs, ttfts, tpots, 1.0, None))
        rows[-1].reference_matches = sum(o == r for o, r in zip(outs, reference))
        s.bar.update(1)
    return rows, reference


def _batchserve_row(
    s: _Sweep,
    dataset: str,
    b: int,
    method: str,
    prompts: list[list[int]],
    reference: list[list[int]],
    work: Workload,
    rate: float | None = None,
) -> Row:
    """One run of a batchserve method at batch size b (with `rate`: an open loop of that many
    requests per second, at most b running), checked against its reference."""
    m = batchserve_method(method)
    assert m is not None
    run = run_batchserve(
        s.engine_model,
        s.tokenizer,
        prompts,
        s.max_new,
        b,
        m,
        work.warm,
        s.decoding_length,
        s.cost_profiles.get(m.kernels),
        work.earlier[: len(prompts)],
        None if rate is None else poisson_arrivals(len(prompts), rate),
    )
    key = (dataset, b, rate)
    expected = expected_outputs(method, m.cpu_weights, reference, s.own_references, key, run.outputs)
    lossless = None if expected is None else run.outputs == expected
    row = make_row(method, dataset, b, run.outputs, run.seconds, run.ttfts, run.tpots, run.tokens_per_step, lossless)
    row.mean_decoding_length = run.mean_len
    row.cached_share = None if run.cached_share is None else round(run.cached_share, 3)
    row.request_rate = rate
    run.phases.apply(row)
    s.bar.update(1)
    at = f"b={b}" if rate is None else f"{rate} req/s"
    s.bar.set_postfix_str(f"{dataset} {method} {at}: {row.tokens_per_s} tok/s")
    return row


def _batch_rows(
    s: _Sweep,
    dataset: str,
    b: int,
    prompts: list[list[int]],
    reference: list[list[int]],
    work: Workload,
    rate: float | None = None,
) -> list[Row]:
    """At batch size b: the hf-batch row, and per batchserve method the run kept of `repeats`
    (taken in rounds over the methods). With `rate`, the batchserve methods in an open loop
    (hf-batch takes its whole batch at once: it has no open loop)."""
    rows: list[Row] = []
    if "hf-batch" in s.methods and rate is None:
        outs, secs, ttfts, tpots = run_hf_batch(s.ref_model, prompts, s.max_new, b)
        rows.append(make_row("hf-batch", dataset, b, outs, secs, ttfts, tpots, 1.0, None))
        s.bar.update(1)
    runs: dict[str, list[Row]] = {}
    for _ in range(s.repeats):
        for m in s.methods:
            if batchserve_method(m) is not None:
                runs.setdefault(m, []).append(_batchserve_row(s, dataset, b, m, prompts, reference, work, rate))
    rows.extend(pick_run(rs, s.keep) for rs in runs.values())
    return rows


def run(
    datasets: list[str],
    methods: list[str],
    batch_sizes: list[int],
    num_prompts: int,
    max_new: int,
    out_dir: Path,
    model_path: str | None,
    decoding_length: int = 16,
    dtype: str = "float32",
    repeats: int = 1,
    keep: str = "fastest",
    waves: int = 0,
    request_rates: list[float] | None = None,
) -> list[Row]:
    """Batch size b runs max(`num_prompts`, `waves` * b) prompts: with too few, the loop
    drains (the batch is below b for the last requests), and a method whose requests end at
    different steps is measured at a smaller batch than b.

    `repeats` > 1 runs every batchserve (method, batch) that many times, in rounds over the
    methods, and keeps the fastest run (`keep="fastest"`: interference on a shared machine
    mostly slows a run down) or the median one (`keep="median"`: robust to a lucky run as
    well as an unlucky one). Rounds spread drift over all methods alike. Every run is
    checked for losslessness.

    `request_rates` adds, per rate, an open loop of Poisson arrivals (the same schedule for every
    method) with at most max(`batch_sizes`) running, over max(`num_prompts`, `waves` x that) prompts."""
    if keep not in KEEP:
        raise ValueError(f"keep must be one of {KEEP}, got {keep!r}")
    from batchserve.runner import load_model

    gguf, skipped = llamacpp_gguf(model_path) if "llamacpp" in methods else (None, "")
    if skipped:  # an optional peer: the sweep goes on without it, and the report says why
        tqdm.write(skipped)
        methods = [m for m in methods if m != "llamacpp"]
    out_dir.mkdir(parents=True, exist_ok=True)
    ref_model, tokenizer = load_model(model_path, dtype)
    engine_model = load_model(model_path, dtype)[0] if any(batchserve_method(m) for m in methods) else None
    cost_profiles = _cost_profiles(methods, engine_model, tokenizer)
    count = {b: max(num_prompts, waves * b) for b in batch_sizes}
    rates = list(request_rates or [])
    runs_per_point = sum(m not in SINGLE for m in methods) * repeats
    total = len(datasets) * (
        sum(m in SINGLE for m in methods)
        + len(batch_sizes) * runs_per_point
        + len(rates) * sum(batchserve_method(m) is not None for m in methods) * repeats
    )
    bar = tqdm(total=total, desc="bench", unit="run")
    s = _Sweep(
        methods, max_new, decoding_length, repeats, keep, ref_model, engine_model, tokenizer, cost_profiles, bar, gguf
    )
    rows: list[Row] = []
    for dataset in datasets:
        work = load_dataset(dataset, max(count.values()), tokenizer)
        if len(work.prompts) < max(count.values()):
            tqdm.write(f"{dataset}: {len(work.prompts)} test prompts, fewer than the {max(count.values())} asked for")
        peer_rows, reference = _peer_rows(s, dataset, work.prompts, num_prompts)
        rows.extend(peer_rows)
        for b in batch_sizes:
            rows.extend(_batch_rows(s, dataset, b, work.prompts[: count[b]], reference[: count[b]], work))
            save_results(rows, out_dir)  # after every batch size, so an interrupted sweep keeps what it measured
        cap, n = max(batch_sizes), max(count.values())
        for rate in rates:
            rows.extend(_batch_rows(s, dataset, cap, work.prompts[:n], reference[:n], work, rate))
            save_results(rows, out_dir)
    bar.close()
    write_report(rows, out_dir, num_prompts, max_new, decoding_length, repeats, keep, waves, skipped)
    plot(rows, out_dir / "throughput.png")
    return rows

"""`batchserve bench`: batchserve's drafters against real peers, one run, one machine.

Batch size b: b requests in flight (a closed loop). Every batchserve output is compared with HF
`generate` greedy (`lossless`); on a GPU with the same engine's `none`, where a difference at a
near-tie of `none`'s logits is rounding (`near_ties`) and one beyond it a bug. Writes
DIR/results.json and DIR/report.md as each row finishes, and a repeated run's row after each round
(a sweep stopped by a time limit keeps what it measured), and DIR/throughput.png at the end.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import closing, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from batchserve.bench.compiled import HF_STATIC, StaticPeer, decode_limit_ms
from batchserve.bench.crashes import PeerFailed, peer_notes
from batchserve.bench.host import stop_ids
from batchserve.bench.llamacpp_child import LlamaCppChild, load_llamacpp
from batchserve.bench.load import poisson_arrivals
from batchserve.bench.methods import (
    KEEP,
    LLAMA_SERVER,
    PEERS,
    SERVED,
    SINGLE,
    Row,
    batchserve_method,
    expected_outputs,
    make_row,
    pick_run,
    provisional_rows,
)
from batchserve.bench.near_ties import divergences, judge
from batchserve.bench.peers import peer_row, run_hf, run_hf_batch
from batchserve.bench.plots import plot
from batchserve.bench.report import save_results, write_report
from batchserve.bench.runs import Workload, cost_profiles, load_dataset, run_batchserve
from batchserve.bench.served import ServedPeers
from batchserve.bench.sweep_setup import optional_peers, reference_model, runs_per_dataset, served_peers

if TYPE_CHECKING:
    from batchserve.cost_profile import CostProfile


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
    # llama.cpp's child process, with the engine's stop ids; `llamacpp_rounds`: it runs at batch 1 in
    # the batchserve methods' rounds, `repeats` times (its speed moves with the machine's as theirs do)
    llamacpp: tuple[LlamaCppChild, frozenset[int]] | None = None
    llamacpp_rounds: bool = False
    on_device: bool = False  # the engine runs on a GPU: each method is judged against its own `none`
    own_references: dict[tuple[str, int], list[list[int]]] = field(default_factory=dict)  # `none-gguf`'s
    rows: list[Row] = field(default_factory=list)  # the finished rows, in the order they finished
    provisional: list[Row] = field(default_factory=list)  # repeated runs' rows as they stand (`add`)
    write: Callable[[list[Row]], None] | None = None  # results.json and report.md of the rows so far
    served: ServedPeers | None = None  # the served rows' servers (bench/served.py)
    failures: list[str] = field(default_factory=list)  # the peers that failed (llama.cpp's: on both kernels)
    hf_static: StaticPeer = HF_STATIC  # its runs and its decode limit

    def add(self, row: Row | None = None, provisional: list[Row] | None = None) -> None:
        """A finished row kept, `provisional` (repeated runs' rows so far) beside until the next call; all written."""
        self.rows, self.provisional = self.rows + ([row] if row is not None else []), provisional or []
        if self.write is not None:
            self.write(self.rows + self.provisional)

    def fail(self, method: str, dataset: str, error: PeerFailed) -> None:
        """A peer's run that failed: said now and in the report, and the sweep goes on."""
        self.failures.append(f"`{method}` on {dataset} failed: {error}.")
        tqdm.write(self.failures[-1])
        self.add(provisional=self.provisional)

    def close(self) -> None:
        """Stop llama.cpp's child process, if one runs (the next dataset's starts its own)."""
        if self.llamacpp is not None:
            self.llamacpp[0].close()
            self.llamacpp = None


def _peer_rows(
    s: _Sweep, dataset: str, prompts: list[list[int]], num_prompts: int, constrained: bool = False
) -> list[list[int]]:
    """HF greedy for every prompt where a row is judged against it (else empty lists); batch-1 peers add
    their rows. Structured output: no peer runs (each method checks against its own plain decoding)."""
    eos, first, none = s.tokenizer.eos_token_id, prompts[:num_prompts], [[] for _ in prompts]
    s.close()  # the last dataset's llama.cpp
    judged = _needs_hf(s.methods, s.on_device)
    if constrained or not (judged or set(s.methods) & set(SINGLE)):
        return none
    reference: list[list[int]] = []
    if judged or "hf" in s.methods:  # its first `num_prompts` are also the `hf` row
        run = run_hf(s.ref_model, first, s.max_new, eos, None, f"{dataset} hf")
        reference, *_ = run
        if "hf" in s.methods:
            s.add(peer_row("hf", dataset, 1, run, 1.0, None))
            s.bar.update(1)
        if judged and len(prompts) > num_prompts:
            rest, *_ = run_hf(s.ref_model, prompts[num_prompts:], s.max_new, eos, None, f"{dataset} reference")
            reference = reference + rest
    if "hf-static" in s.methods:  # the `keep` one of its runs
        s.bar.update(1)
        desc, limit, runs = f"{dataset} hf-static", decode_limit_ms(s.ref_model, s.hf_static.max_ms), []
        try:  # each proven compiled and within its decode limit (bench/compiled.py), or the row fails
            for _ in range(s.hf_static.repeats):
                run = run_hf(s.ref_model, first, s.max_new, eos, None, desc, static=True, max_decode_ms=limit)
                outs, *_ = run
                same = outs == reference[:num_prompts] if reference else None
                runs.append(peer_row("hf-static", dataset, 1, run, 1.0, same))
                s.add(provisional=provisional_rows([runs], s.keep))
            s.add(pick_run(runs, s.keep))
        except PeerFailed as e:
            s.provisional = []
            s.fail("hf-static", dataset, e)
    if "hf-prompt-lookup" in s.methods:
        run = run_hf(s.ref_model, first, s.max_new, eos, 10, f"{dataset} hf-prompt-lookup")
        s.add(peer_row("hf-prompt-lookup", dataset, 1, run, None, None))
        s.bar.update(1)
    if "llamacpp" in s.methods and s.gguf is not None:  # a context for this dataset's longest prompt
        s.llamacpp = load_llamacpp(s.gguf, prompts, s.max_new), stop_ids(s.ref_model, s.tokenizer)
        if not s.llamacpp_rounds and (row := _llamacpp_row(s, dataset, first, reference)):
            s.add(row)
    return reference or none


def _llamacpp_row(s: _Sweep, dataset: str, prompts: list[list[int]], reference: list[list[int]]) -> Row | None:
    """One run of llama.cpp greedy over the prompts, one at a time; how many equal HF's. None:
    it failed on both of llama.cpp's kernels (`s.fail` says why)."""
    assert s.llamacpp is not None
    peer, stop = s.llamacpp
    s.bar.update(1)
    try:
        run = peer.run(prompts, s.max_new, stop, f"{dataset} llamacpp")
    except PeerFailed as e:
        s.fail("llamacpp", dataset, e)
        return None
    row = peer_row("llamacpp", dataset, 1, run, 1.0, None)
    outs, *_ = run
    row.reference_matches = sum(o == r for o, r in zip(outs, reference))
    row.note = peer.note  # it ran on llama.cpp's fallback kernels
    return row


def _needs_hf(methods: list[str], on_device: bool = False) -> bool:
    """Whether rows are judged against HF greedy: llama.cpp's, and a float32 method's on a CPU
    (served rows check against the in-process plain decoding on make serve's weights; on a GPU
    every method checks against the same engine's `none`: HF's kernels round otherwise)."""
    ours = [batchserve_method(m) for m in methods if m not in PEERS]
    return "llamacpp" in methods or (not on_device and any(m is not None and m.cpu_weights == "float32" for m in ours))


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
        predictions=work.predictions[: len(prompts)],
        constraints=work.constraints[: len(prompts)],
    )
    key = (dataset, b, rate)
    expected = expected_outputs(
        method, m.cpu_weights, reference, s.own_references, key, run.outputs, work.constrained, s.on_device
    )
    lossless = None if expected is None else run.outputs == expected
    row = make_row(
        method, dataset, b, run.outputs, run.seconds, run.ttfts, run.tpots, run.tokens_per_step, lossless, run.decode
    )
    if s.on_device and expected is not None and not lossless:
        # NOTE: the reference is the same engine's `none`, whose bf16 kernels round otherwise at
        # other row counts: a difference at a near-tie is rounding, one beyond it a bug.
        judge(row, divergences(s.ref_model, prompts, run.outputs, expected))
    row.mean_decoding_length = run.mean_len
    row.cached_share = None if run.cached_share is None else round(run.cached_share, 3)
    if run.second_round_tokens_per_step is not None:
        row.repeat_tokens_per_step = round(run.second_round_tokens_per_step, 3)
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
) -> None:
    """At batch size b: the hf-batch row, and per batchserve method the run kept of `repeats`
    (taken in rounds over the methods), each added as it is final (a single run at once, a
    repeated one after its last round). With `rate`, the batchserve methods in an open loop
    (hf-batch takes its whole batch at once: it has no open loop)."""
    if "hf-batch" in s.methods and rate is None:
        s.add(peer_row("hf-batch", dataset, b, run_hf_batch(s.ref_model, prompts, s.max_new, b), 1.0, None))
        s.bar.update(1)
    runs: dict[str, list[Row]] = {}
    with_llamacpp = s.llamacpp_rounds and s.llamacpp is not None and b == 1 and rate is None
    for _ in range(s.repeats):
        if with_llamacpp and (row := _llamacpp_row(s, dataset, prompts, reference)):
            runs.setdefault("llamacpp", []).append(row)
        for m in s.methods:
            if batchserve_method(m) is not None:
                row = _batchserve_row(s, dataset, b, m, prompts, reference, work, rate)
                runs.setdefault(m, []).append(row)
                if s.repeats == 1:
                    s.add(row)
        for m in s.methods:  # after the in-process rows: their plain decoding is the served rows' reference
            if m in SERVED + LLAMA_SERVER and rate is None and (row := _served_row(s, dataset, b, m, prompts, work)):
                runs.setdefault(m, []).append(row)
                if s.repeats == 1:
                    s.add(row)
        if s.repeats > 1:  # a sweep cut in a later round keeps this one's rows
            s.add(provisional=provisional_rows(runs.values(), s.keep))
    if s.repeats > 1:
        for rs in runs.values():
            s.add(pick_run(rs, s.keep))


def _served_row(s: _Sweep, dataset: str, b: int, method: str, prompts: list[list[int]], work: Workload) -> Row | None:
    """A served method's run at b in flight, against the in-process plain decoding of make serve's
    weights. None: llama-server failed on both of llama.cpp's kernels (`s.fail` says why)."""
    assert s.served is not None
    own = s.own_references.get((s.served.weights, (dataset, b, None)))
    # The server streams text without special tokens (the end-of-sequence one included).
    reference = [s.tokenizer.decode(o, skip_special_tokens=True) for o in own] if own is not None else None
    s.bar.update(1)
    try:
        row = s.served.row(method, dataset, b, prompts, s.max_new, work.warm, reference)
    except PeerFailed as e:
        s.fail(method, dataset, e)
        return None
    s.bar.set_postfix_str(f"{dataset} {method} b={b}: {row.tokens_per_s} tok/s")
    return row


def _dataset_rows(s: _Sweep, dataset: str, num_prompts: int, count: dict[int, int], rates: list[float]) -> None:
    """One dataset's rows, each added (and written) as it finishes: the peers, each batch size,
    then each request rate."""
    n = max(count.values())
    work = load_dataset(dataset, n, s.tokenizer)
    if len(work.prompts) < n:
        tqdm.write(f"{dataset}: {len(work.prompts)} test prompts, fewer than the {n} asked for")
    reference = _peer_rows(s, dataset, work.prompts, num_prompts, work.constrained)
    for b in count:
        _batch_rows(s, dataset, b, work.prompts[: count[b]], reference[: count[b]], work)
    for rate in rates:
        _batch_rows(s, dataset, max(count), work.prompts[:n], reference[:n], work, rate)


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
    hf_static: StaticPeer = HF_STATIC,
) -> list[Row]:
    """Batch size b runs max(`num_prompts`, `waves` * b) prompts: with too few, the loop
    drains (the batch is below b for the last requests), and a method whose requests end at
    different steps is measured at a smaller batch than b.

    `repeats` > 1 runs every batchserve (method, batch) that many times, in rounds over the
    methods (llamacpp too, at batch 1), and keeps the fastest run (`keep="fastest"`:
    interference on a shared machine mostly slows a run down) or the median one
    (`keep="median"`: robust to a lucky run as well as an unlucky one). Rounds spread drift
    over all methods alike. Every run is checked for losslessness. `hf_static`: how hf-static runs.

    `request_rates` adds, per rate, an open loop of Poisson arrivals (the same schedule for every
    method) with at most max(`batch_sizes`) running, over max(`num_prompts`, `waves` x that) prompts."""
    if keep not in KEEP:
        raise ValueError(f"keep must be one of {KEEP}, got {keep!r}")
    from batchserve.model.loader import load_model

    methods, gguf, llama_server, skipped = optional_peers(methods, model_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    ref_model, tokenizer = reference_model(methods, model_path, dtype)
    engine_model = load_model(model_path, dtype)[0] if any(batchserve_method(m) for m in methods) else None
    profiles = cost_profiles(methods, engine_model, tokenizer)
    count, rates = {b: max(num_prompts, waves * b) for b in batch_sizes}, list(request_rates or [])
    llamacpp_rounds = "llamacpp" in methods and repeats > 1 and 1 in batch_sizes
    total = len(datasets) * runs_per_dataset(methods, batch_sizes, rates, repeats, llamacpp_rounds)
    bar = tqdm(total=total, desc="bench", unit="run")
    s = _Sweep(methods, max_new, decoding_length, repeats, keep, ref_model, engine_model, tokenizer, profiles, bar)
    s.gguf, s.llamacpp_rounds, s.hf_static = gguf, llamacpp_rounds, hf_static
    s.on_device = engine_model is not None and engine_model.device.type != "cpu"
    s.served = served_peers(methods, model_path, engine_model, batch_sizes, out_dir / "logs", llama_server)
    by_kernels = {"-".join(str(k) for k in kernels if k): p for kernels, p in profiles.items()}

    def write(rows: list[Row]) -> None:
        said = "\n\n".join(filter(None, (skipped, *peer_notes(rows, s.failures))))  # and llama.cpp's crashes
        save_results(rows, out_dir)
        write_report(rows, out_dir, num_prompts, max_new, decoding_length, repeats, keep, waves, said, by_kernels)

    s.write = write
    write(s.rows)  # the header and the cost profiles before the first row
    with s.served or nullcontext(), closing(s):  # every server and child started is stopped, however it ends
        for dataset in datasets:
            _dataset_rows(s, dataset, num_prompts, count, rates)
    bar.close()
    plot(s.rows, out_dir / "throughput.png")
    return s.rows

"""One batchserve run of a workload and what it measured: the engine built for a method, a closed
or an open loop over the prompts, latencies, step phases; and the workloads themselves."""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from batchserve import heap
from batchserve.bench.datasets import REPEAT, Sample, load_samples, split, split_workload
from batchserve.bench.load import open_loop, open_loop_latencies
from batchserve.bench.methods import Method, Row, batchserve_method
from batchserve.bench.samples import encode
from batchserve.bench.served_loop import ServedSteps
from batchserve.records import SchedulerOutput, StepPhases
from batchserve.request import tokens_per_step

if TYPE_CHECKING:
    from batchserve.cost_profile import CostProfile


@dataclass(slots=True)
class PhaseTotals:
    """Sums of the engine's step phases over a run (a step listener)."""

    batch_size: int  # a full decode step runs this many requests
    steps: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys((*StepPhases.NAMES, "wall"), 0.0))
    attention: float | None = None  # seconds inside the attention backend, where it is timed
    grammar: float = 0.0  # seconds in grammar matchers and masks (structured output)
    decode_steps: int = 0  # full steps without a prompt chunk: one committed token per request
    decode_wall: float = 0.0
    # Steps with every seat taken (batch_size requests, prompt chunks included): a closed loop
    # without its ramp-up and its tail, where fewer requests are left than seats. How requests
    # happen to finish moves the tail (equal-length requests without drafts finish together).
    seated_wall: float = 0.0
    seated_tokens: int = 0
    served: ServedSteps | None = None  # the loop that serves, per full step

    def add(self, out: SchedulerOutput, phases: StepPhases) -> None:
        if not out.requests:
            return
        if self.served is not None:
            self.served.add(out, phases)
        self.steps += 1
        for name, t in phases.items():
            self.seconds[name] += t
        self.seconds["wall"] += phases.wall
        if phases.attention is not None:
            self.attention = (self.attention or 0.0) + phases.attention
        self.grammar += phases.grammar
        if len(out.requests) == self.batch_size:
            self.seated_wall += phases.wall
            self.seated_tokens += phases.tokens
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
            if self.grammar:
                row.phase_ms["grammar"] = round(self.grammar * 1e3 / self.steps, 3)
        if self.decode_steps:
            row.decode_step_ms = round(self.decode_wall * 1e3 / self.decode_steps, 3)
        if self.seated_wall > 0:
            row.seated_tokens_per_s = round(self.seated_tokens / self.seated_wall, 3)
        if self.served is not None:
            row.served_step = self.served.summary()


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
    second_round_tokens_per_step: float | None = None  # exact repeats run after the first round: theirs
    # per request with 2+ tokens: (tokens after the first, seconds from the first token's step to the last's)
    decode: list[tuple[int, float]] = field(default_factory=list)


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
    predictions: list[str] = (),  # type: ignore[assignment]
    constraints: list[str] = (),  # type: ignore[assignment]
) -> EngineRun:
    """One batchserve method at batch size b, on the server's default KV pool (a smaller one
    evicts the cached prefixes a workload shares). `earlier` prompts (a conversation's first
    turns) run first, unmeasured, on the same engine. With `arrivals` (seconds from the start,
    one per prompt) the load is an open loop (`load.open_loop`) with at most b running. A
    `+prediction` method sends each prompt's `predictions` entry as its predicted output; a
    prompt's `constraints` entry, if any, is the JSON Schema its output must match."""
    from batchserve import SamplingParams

    llm = method_engine(engine_model, tokenizer, m, b, decoding_length, cost_profile, max_num_batched_tokens)
    if m.warm:  # the dev outputs into the trie, as a server's admin loads a corpus (`add_corpus`)
        for _ in llm.engine.add_corpus(warm):
            pass
    if earlier:  # the conversations so far reach the server first (one token each: their KV is what counts)
        llm.generate(earlier, SamplingParams(max_new_tokens=1))
    phases = PhaseTotals(b, served=ServedSteps(b, llm.engine.outputs_beside_forward))
    llm.engine.step_listeners.append(phases.add)
    params = _params(m, max_new, constraints)
    refs = [p or None for p in predictions] if m.predicted and predictions else None
    second = None  # a +repeat workload's second round
    if arrivals is not None:
        with heap.settled():  # as `batchserve serve` runs: no full collections over the loaded engine
            results, due, seconds = open_loop(llm, prompts, params, arrivals, refs)
        ttfts, tpots = open_loop_latencies(results, due)
    else:
        rounds = rounds_of(prompts)  # exact repeats: the second round after the first has finished
        with heap.settled():
            results, seconds = _closed_loop(llm, prompts, rounds, params, refs)
        ttfts = closed_loop_ttfts(results, b)
        tpots = [(r.finish_time - r.first_token_time) / (len(r.token_ids) - 1) for r in results if len(r.token_ids) > 1]
        second = results[rounds[1]] if len(rounds) == 2 else None
    steps = sum(r.stats.steps for r in results)
    mean_len = sum(r.stats.draft_tokens_proposed for r in results) / max(1, steps)
    cached = sum(r.stats.cached_prompt_tokens for r in results) / max(1, sum(map(len, prompts)))
    cached_share = cached if m.prefix_caching else None
    outputs = [r.token_ids for r in results]
    tps, second_tps = _tokens_per_step(results), None if second is None else _tokens_per_step(second)
    ends = [(len(r.token_ids) - 1, r.token_times) for r in results if len(r.token_ids) > 1 and r.token_times]
    decode = [(k, times[-1] - times[0]) for k, times in ends]
    return EngineRun(outputs, seconds, ttfts, tpots, tps, mean_len, phases, cached_share, second_tps, decode)


def _params(m: Method, max_new: int, constraints: list[str]) -> Any:
    """The sampling parameters of a run's requests: one for all, or one per prompt where a prompt
    has a constraint. A `+logprobs` method's requests each ask for their tokens' logprobs."""
    from batchserve import SamplingParams
    from batchserve.request import Constraint

    params = SamplingParams(max_new_tokens=max_new, logprobs=m.logprobs)
    if not any(constraints):
        return params
    return [replace(params, constraint=Constraint("json_schema", c) if c else None) for c in constraints]


def _tokens_per_step(results: list) -> float:
    return tokens_per_step(sum(len(r.token_ids) for r in results), sum(r.stats.steps for r in results))


def _closed_loop(
    llm: Any, prompts: list[list[int]], rounds: list[slice], params: Any, refs: list[str | None] | None
) -> tuple[list, float]:
    """Each round's prompts queued at once (the engine runs as many as it seats), one round after
    the other: the results and the seconds the rounds took."""
    results: list = []
    seconds = 0.0
    for part in rounds:
        t0 = time.perf_counter()
        results += llm.generate(
            prompts[part],
            params if not isinstance(params, list) else params[part],
            use_tqdm=False,
            references=None if refs is None else refs[part],
        )
        seconds += time.perf_counter() - t0
    return results, seconds


def rounds_of(prompts: list[list[int]]) -> list[slice]:
    """A list that is the same prompts twice (a `+repeat` workload) runs in two rounds, the
    second once the first has finished (its outputs are then in the trie); else one round."""
    half = len(prompts) // 2
    if half and len(prompts) % 2 == 0 and prompts[:half] == prompts[half:]:
        return [slice(0, half), slice(half, None)]
    return [slice(0, len(prompts))]


# The forward each loaded model was built into, per kernel set: a sweep's many engines on one
# set share it (building one repacks every weight, about 0.5 s for SmolLM2).
_FORWARDS: weakref.WeakKeyDictionary[Any, dict[tuple[str, str, str], Any]] = weakref.WeakKeyDictionary()


def forward_for(model: Any, m: Method) -> Any:
    """The model method `m`'s engines run: `model` (as loaded) built for m's kernels, once."""
    from batchserve.bench.host import build_forward

    built = _FORWARDS.setdefault(model, {})
    if m.kernels not in built:
        forward = build_forward(model, m.model_impl, m.cpu_linear, m.cpu_weights)
        built[m.kernels] = None if forward is model else forward  # None: as loaded (no cycle to the key)
    return built[m.kernels] or model


def method_engine(
    model: Any, tokenizer: Any, m: Method, b: int, decoding_length: int, profile: Any, token_budget: int | None
) -> Any:
    """An offline engine with method `m`'s settings and at most b running."""
    from batchserve import LLM

    return LLM(
        draft=m.draft,
        draft_layout=m.layout,
        decoding_length=m.decoding_length or decoding_length,
        adaptive=m.adaptive,
        max_num_seqs=b,
        hf_model=forward_for(model, m),
        tokenizer=tokenizer,
        cost_profile=profile,
        cpu_linear=m.cpu_linear,
        model_impl=m.model_impl,
        cpu_weights=m.cpu_weights,
        prefix_caching=m.prefix_caching,
        **({} if token_budget is None else {"max_num_batched_tokens": token_budget}),
        **(dict(zip(("window_size", "ngram_size", "guesses"), m.jacobi)) if m.jacobi else {}),
    )


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
    predictions: list[str] = field(default_factory=list)  # each prompt's sample's prediction ("": none)
    constraints: list[str] = field(default_factory=list)  # each prompt's JSON Schema ("": unconstrained)

    @property
    def constrained(self) -> bool:
        """Structured output: HF's unconstrained greedy is no reference; each method's own plain run is."""
        return any(self.constraints)


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
    predictions = [s.prediction for s in test[:unique]]
    constraints = [s.constraint for s in test[:unique]]
    if base != name:
        prompts, earlier = (prompts + prompts)[:num_prompts], (earlier + earlier)[:num_prompts]
        predictions = (predictions + predictions)[:num_prompts]
        constraints = (constraints + constraints)[:num_prompts]
    return Workload(prompts, warm, earlier, predictions, constraints)


def _conversation_so_far(first: Sample, tokenizer: Any) -> list[int]:
    """A first turn and its reference reply, as a chat client's history stands before the
    second turn (rendered without a generation prompt: the second turn's prompt starts so)."""
    messages = [*first.messages(), {"role": "assistant", "content": first.reference}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def cost_profiles(methods: list[str], engine_model: Any, tokenizer: Any) -> dict[tuple[str, str], CostProfile]:
    """The profiles the server would use (cached per device, dtype, model and kernels; measured if absent)."""
    cost_profiles = {}
    specs = [batchserve_method(m) for m in methods]
    for m in {m.kernels: m for m in specs if m is not None and m.adaptive}.values():
        from batchserve import LLM

        kw = dict(cpu_linear=m.cpu_linear, model_impl=m.model_impl, cpu_weights=m.cpu_weights)
        probe = LLM(adaptive=True, hf_model=forward_for(engine_model, m), tokenizer=tokenizer, **kw)
        cost_profiles[m.kernels] = probe.engine.cost_profile
        del probe
    return cost_profiles

"""`batchserve bench --simulate --curve FILE`: predicted tokens/s of `none` and `lookahead-adaptive`
for a model this machine need not run, from replayed acceptance and a cost curve.

What drafts are worth comes from the replay `--simulate` does: the trie drafter, warmed on a
dataset's dev outputs, proposes trees for each test prompt (SmolLM2's tokens), and a walk accepts
the nodes that match the reference output (target-guided, as `draft/simulate.py`). What a step
costs comes from a curve: curve.json measured on the GPU (`bench --shape NAME --curve-out DIR`),
any cost profile, or the built-in synthetic one (`curve.load_curve`). The adaptive policy runs on
that curve as the engine runs it: `PolicyDrafts` over `DraftBudgetPolicy.from_config(profile,
DraftConfig())` (hopeful requests, proposals, shadow drafts, the allocation, the speed guard's
baseline steps and hedge), its trackers taught by `OpenJudgements` as the planner teaches them
(`simulate.Speculation`: the drafter and the policy live in `simulate.py`, past the public API).

Per in-flight count b, a closed loop of b seats over the test samples (outputs cut at max_new):
- none: each running request emits one token; the step costs the profile's time for b rows of b
  requests;
- lookahead-adaptive: each request emits what the walk accepts of its verified tree, plus one; the
  step costs the profile's time for its rows, the draft rows among them.
Tokens/s counts the steps with every seat taken (the loop's ramp and tail excluded), or every step
where the samples never fill b seats. The same curve prices both methods and is the policy's
belief too: a prediction is only as good as the curve.

Not modelled: prompt prefill (both methods pay it alike); host time (drafting and scheduling, which
on a GPU overlap the forward: the host budget is never told a step's time, so it never pauses
planning or rations shadow drafts); a device engine's trie learning a step late (`LearnsLater`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from batchserve.bench.simulate import Encoded, Speculation, verify
from batchserve.config import DraftConfig, SchedulerConfig
from batchserve.cost_profile import CostProfile
from batchserve.request import Request, SamplingParams

IN_FLIGHT = (1, 2, 4, 8, 16, 32, 64)
TOKEN_BUDGET = SchedulerConfig().max_num_batched_tokens  # the engine's default rows per step


@dataclass(frozen=True, slots=True)
class Prediction:
    """One in-flight count's predicted decode throughput."""

    in_flight: int
    none_tokens_per_s: float
    adaptive_tokens_per_s: float
    draft_tokens: float  # lookahead-adaptive: verified draft tokens per request step
    tokens_per_step: float  # lookahead-adaptive: tokens a request emits per step
    full_steps: int  # lookahead-adaptive's steps with every seat taken (0: all its steps were counted)

    @property
    def ratio(self) -> float:
        """lookahead-adaptive's tokens/s over none's (0 where none emitted nothing)."""
        return self.adaptive_tokens_per_s / self.none_tokens_per_s if self.none_tokens_per_s > 0 else 0.0


@dataclass(slots=True)
class Tally:
    """A loop's totals over the steps it counts."""

    steps: int = 0
    tokens: int = 0
    ms: float = 0.0
    request_steps: int = 0
    draft_tokens: int = 0

    def add(self, tokens: int, ms: float, requests: int, drafts: int) -> None:
        self.steps += 1
        self.tokens += tokens
        self.ms += ms
        self.request_steps += requests
        self.draft_tokens += drafts

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.ms * 1e3 if self.ms > 0 else 0.0


@dataclass(slots=True)
class _Seat:
    request: Request
    output: list[int]  # the reference output the request emits
    done: int = 0  # its tokens emitted so far

    @classmethod
    def of(cls, request_id: str, sample: Encoded) -> _Seat:
        params = SamplingParams(max_new_tokens=len(sample.output))
        total = len(sample.prompt) + len(sample.output) + 1
        return cls(Request(request_id, list(sample.prompt), params, frozenset(), total), list(sample.output))

    @property
    def left(self) -> int:
        return len(self.output) - self.done


def run_loop(
    profile: CostProfile,
    samples: Sequence[Encoded],
    in_flight: int,
    speculation: Speculation | None = None,
    token_budget: int = TOKEN_BUDGET,
) -> tuple[Tally, Tally]:
    """A closed loop of `in_flight` seats over `samples`, without drafts or with `speculation`'s:
    (the tally of the steps with every seat taken, the tally of all steps)."""
    waiting = deque(enumerate(samples))
    seats: list[_Seat] = []
    full, every = Tally(), Tally()
    while waiting or seats:
        while len(seats) < in_flight and waiting:
            i, s = waiting.popleft()
            if s.output:
                seats.append(_Seat.of(f"sim-{i}", s))
                if speculation is not None:
                    speculation.start(seats[-1].request)
        if not seats:
            break
        n = len(seats)
        context = sum(s.request.num_tokens for s in seats) / n  # mean KV length, as the planner's
        trees = speculation.plan(seats, context, token_budget - n) if speculation is not None else {}
        tokens = 0
        for s in seats:
            rid = s.request.request_id
            emitted = verify(trees.get(rid), s.output, s.done)
            s.done += len(emitted)
            s.request.all_token_ids.extend(emitted)
            s.request.output_token_ids.extend(emitted)
            tokens += len(emitted)
            if speculation is not None:
                speculation.commit(rid, emitted)
        drafts = sum(map(len, trees.values()))
        ms = profile.time_ms(n + drafts, context, n, draft_rows=drafts)
        if speculation is not None:
            speculation.observe(n, tokens, ms, drafts > 0)
        every.add(tokens, ms, n, drafts)
        if n == in_flight:
            full.add(tokens, ms, n, drafts)
        for s in seats:
            if s.left <= 0 and speculation is not None:
                speculation.finish(s.request.request_id)
        seats = [s for s in seats if s.left > 0]
    return full, every


def predict(
    profile: CostProfile,
    warm: list[list[int]],
    test: Sequence[Encoded],
    in_flight: Sequence[int] = IN_FLIGHT,
    token_budget: int = TOKEN_BUDGET,
    config: DraftConfig | None = None,
) -> list[Prediction]:
    """`none` and lookahead-adaptive (`config`, default the engine's: the trie, hierarchical,
    adaptive up to 64 draft tokens a request) at each in-flight count: a fresh trie warmed on
    `warm` for each run, as each bench run builds its own engine."""
    config = config or DraftConfig()
    out = []
    for b in in_flight:
        plain = _counted(*run_loop(profile, test, b, None, token_budget))
        full, every = run_loop(profile, test, b, Speculation(profile, warm, config), token_budget)
        adaptive = _counted(full, every)
        steps = max(1, adaptive.request_steps)
        out.append(
            Prediction(
                b,
                plain.tokens_per_s,
                adaptive.tokens_per_s,
                adaptive.draft_tokens / steps,
                adaptive.tokens / steps,
                full.steps,
            )
        )
    return out


def _counted(full: Tally, every: Tally) -> Tally:
    return full if full.steps else every


def prediction_table(predictions: Sequence[Prediction]) -> str:
    lines = [
        "| in flight | none tok/s | lookahead-adaptive tok/s | ratio | draft tokens / request step | "
        "tokens / request step |",
        "|---|---|---|---|---|---|",
    ]
    for p in predictions:
        lines.append(
            f"| {p.in_flight} | {p.none_tokens_per_s:.1f} | {p.adaptive_tokens_per_s:.1f} | {p.ratio:.2f}x | "
            f"{p.draft_tokens:.2f} | {p.tokens_per_step:.2f} |"
        )
    never = [str(p.in_flight) for p in predictions if p.full_steps == 0]
    if never:
        lines.append(f"\n(too few test samples to fill {', '.join(never)} seats: every step counted there)")
    return "\n".join(lines)


def main(
    datasets: list[str],
    in_flight: Sequence[int],
    num_samples: int,
    model: str | None,
    profile: CostProfile,
    max_new: int,
    token_budget: int = TOKEN_BUDGET,
) -> None:
    """Print, per dataset, the predicted tokens/s table on `profile`."""
    from batchserve.bench.simulate import encoded_split
    from batchserve.model.loader import load_tokenizer

    tokenizer = load_tokenizer(model)
    contexts = ", ".join(f"{c}: {profile.critical_decoding_length(context=c)}" for c in profile.contexts)
    print(f"## Predicted decode tokens/s on the cost curve {profile.key}")
    print(
        f"(critical decoding length by context: {contexts}; outputs cut at {max_new} tokens; "
        f"at most {token_budget} rows a step; acceptance replayed on SmolLM2's tokens; prefill and host time not "
        "modelled)"
    )
    for name in datasets:
        warm, test = encoded_split(name, num_samples, tokenizer)
        test = [Encoded(e.prompt, e.output[:max_new]) for e in test]
        print(f"\n### {name}: {len(test)} test samples, trie warmed on {len(warm)} dev outputs\n")
        print(prediction_table(predict(profile, warm, test, in_flight, token_budget)))

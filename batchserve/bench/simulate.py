"""The drafters replayed offline: `batchserve bench --simulate`'s step compression of each
drafter without running the model, and the drafter and adaptive policy that `--ceiling` and
`--simulate --curve` (`ceiling.py`, `predict.py`) replay. One of the bench's two modules that
reach past the public API (`bench/__init__.py` names them): the drafters (`draft/`) and the
speculation's policy (`speculation/`) have no public handle, since the engine owns them.

For HumanEval (prompt -> canonical solution) and ShareGPT (first human turn, rendered with
the chat template -> first reply), the trie is warmed on the dev split's outputs and every
test sample is replayed with LLMA's target-guided simulation. Also measures the trie's
retrieval + update time per step on a warmed trie of 100k+ nodes, and its memory. With a cost
curve (`--curve`), the same replay predicts tokens/s instead (`predict.py`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from tqdm import tqdm

from batchserve.bench.datasets import humaneval, sharegpt, split
from batchserve.bench.samples import Encoded, encode
from batchserve.config import DraftConfig
from batchserve.cost_profile import CostProfile
from batchserve.draft import Drafter, SingleBranchDrafter, TrieDrafter, make_drafter
from batchserve.draft.simulate import SimulationResult, simulate
from batchserve.request import Request
from batchserve.speculation.budget import DraftBudgetPolicy, StepShape
from batchserve.speculation.host_budget import HostBudget
from batchserve.speculation.judging import OpenJudgements
from batchserve.speculation.policy_drafts import PolicyDrafts
from batchserve.trees import DraftTree, walk

LAYOUTS = ("single", "parallel", "hierarchical")


def replay(make: Callable[[], Drafter], warm: list[list[int]], test: list[Encoded], length: int) -> SimulationResult:
    drafter = make()
    if isinstance(drafter, TrieDrafter):
        drafter.warm_up(warm)
    total = SimulationResult()
    for i, s in enumerate(test):
        references = [s.prediction] if s.prediction else []
        total.merge(simulate(drafter, f"sim-{i}", s.prompt, s.output, length, references))
    return total


def trie(config: DraftConfig | None = None) -> Callable[[], TrieDrafter]:
    """A maker of fresh trie drafters with `config` (default: the engine's), for `replay`."""
    return lambda: TrieDrafter(config or DraftConfig())


def encoded_split(name: str, num_samples: int, tokenizer: Any) -> tuple[list[list[int]], list[Encoded]]:
    """(the dev outputs that warm the trie, the test samples) of `name`'s first `num_samples`."""
    samples = humaneval() if name == "humaneval" else sharegpt(num_samples)
    dev, test = split(samples[:num_samples])
    return [e.output for e in encode(dev, tokenizer)], encode(test, tokenizer)


def run(datasets: list[str], lengths: list[int], num_samples: int, tokenizer: Any) -> str:
    lines = []
    for name in datasets:
        warm, test_e = encoded_split(name, num_samples, tokenizer)
        lines.append(f"\n### {name}: {len(test_e)} test samples, trie warmed on {len(warm)} dev outputs\n")
        lines.append("| drafter | " + " | ".join(f"L={n}" for n in lengths) + " |")
        lines.append("|---|" + "---|" * len(lengths))
        makers: dict[str, Callable[[], Drafter]] = {"llma (suffix copy)": SingleBranchDrafter}
        for layout in LAYOUTS:
            makers[f"trie {layout}"] = lambda layout=layout: TrieDrafter(DraftConfig(layout=layout))
        makers["trie hierarchical, cold"] = lambda: TrieDrafter(DraftConfig())
        for label, make in tqdm(makers.items(), desc=f"simulate {name}"):
            cold = label.endswith("cold")
            cells = [f"{replay(make, [] if cold else warm, test_e, n).tokens_per_step:.2f}" for n in lengths]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def trie_speed(tokenizer: Any, length: int = 64, min_nodes: int = 100_000) -> str:
    """Median retrieval + update time per request-step on a warmed trie of `min_nodes`+ nodes."""
    samples = sharegpt(6000)
    dev, test = split(samples)
    config = DraftConfig(decoding_length=length, trie_capacity=400_000)
    drafter = TrieDrafter(config)
    warm_texts = [s.reference for s in dev]
    for text in tqdm(warm_texts, desc="warm trie"):
        drafter.warm_up([tokenizer(text, add_special_tokens=False).input_ids])
        if drafter.num_nodes >= min_nodes * 1.5:
            break
    nodes = drafter.num_nodes
    times: list[float] = []
    for i, s in enumerate(tqdm(encode(test[:40], tokenizer), desc="timed replay")):
        times.extend(simulate(drafter, f"t-{i}", s.prompt, s.output[:256], length).step_seconds)
    median_ms = statistics.median(times) * 1e3
    p90_ms = statistics.quantiles(times, n=10)[-1] * 1e3

    # Memory of a trie filled to its default capacity (native: counted by the drafter itself).
    full = TrieDrafter(DraftConfig())
    for s in dev:
        full.warm_up([tokenizer(s.reference, add_special_tokens=False).input_ids])
        if full.num_nodes >= full.config.trie_capacity * 0.95:
            break
    size = full.memory_bytes()
    return (
        f"\nretrieval + update per request-step (decoding length {length}, warmed trie of {nodes:,} nodes): "
        f"median {median_ms:.3f} ms, p90 {p90_ms:.3f} ms over {len(times)} steps\n"
        f"trie memory: {size / 2**20:.1f} MB at {full.num_nodes:,} nodes "
        f"(capacity {full.config.trie_capacity:,}; {size / max(1, full.num_nodes):.0f} bytes/node)"
    )


def main(datasets: list[str], lengths: list[int], num_samples: int, model: str | None, speed: bool = True) -> None:
    from batchserve.model.loader import load_tokenizer

    tokenizer = load_tokenizer(model)
    t0 = time.perf_counter()
    print("## Mean tokens per step (target-guided simulation)")
    print(run(datasets, lengths, num_samples, tokenizer))
    if speed:
        print(trie_speed(tokenizer))
    print(f"\n({time.perf_counter() - t0:.0f} s)")


class Speculation:
    """lookahead-adaptive's side of `predict.py`'s loop: the drafter and the policy, driven as the
    engine's planner (`speculation/planner.py`) drives them, minus host time (`predict.py`'s
    docstring). `plan` takes the loop's seats: anything with `.request` (a `Request`) and `.left`
    (the tokens it has yet to emit)."""

    def __init__(self, profile: CostProfile, warm: list[list[int]], config: DraftConfig) -> None:
        self.cap = config.decoding_length or 0  # the most draft tokens a request verifies in a step
        self.drafter = make_drafter(config)
        if warm:
            self.drafter.warm_up(warm)  # type: ignore[attr-defined]
        self.policy = DraftBudgetPolicy.from_config(profile, config)
        host = HostBudget(config.shadow_share, config.plan_backoff, self.policy.guard)
        self.sizing = PolicyDrafts(self.policy, config, host)
        self.judgements = OpenJudgements()
        self._proposals: dict[str, DraftTree] = {}  # this step's whole proposal per request

    def start(self, req: Request) -> None:
        self.drafter.on_request_start(req.request_id, req.prompt_token_ids)

    def plan(self, seats: list[Any], context: float, budget: int) -> dict[str, DraftTree]:
        """The verified trees of this step's requests, within `budget` draft rows."""
        n = len(seats)
        guard = self.policy.guard
        baseline = guard is not None and guard.wants_plain(n)
        wanted = [(s.request, lim) for s in seats if (lim := min(self.cap, s.left - 1, budget)) > 0]
        if not wanted:
            self._proposals = {}
            return {}
        shape = StepShape(num_roots=n, context=context, num_seqs=n, token_budget=max(0, budget))
        trees = self.sizing.trees(wanted, shape, baseline, self._propose)
        self._proposals = trees.proposals
        return trees.verified

    def _propose(self, req: Request, limit: int) -> DraftTree | None:
        tree = self.drafter.propose(req.request_id, req.all_token_ids, limit) if limit > 0 else None
        return tree if tree is not None and len(tree) else None

    def commit(self, request_id: str, emitted: list[int]) -> None:
        """The request emitted `emitted`: its proposals judged (this step's and open earlier ones),
        the drafter told."""
        tracker = self.policy.tracker
        now, late = self.judgements.judge(request_id, self._proposals.pop(request_id, None), emitted)
        if now is None:
            tracker.skipped(request_id)
        else:
            tracker.observe(request_id, now.stop, now.hits, now.scores, now.match)
        for d in late:
            tracker.observe_late(request_id, d.start, d.stop, d.hits, d.scores, d.match)
        self.drafter.on_tokens_accepted(request_id, emitted)

    def observe(self, num_seqs: int, tokens: int, ms: float, drafted: bool) -> None:
        if self.policy.guard is not None:
            self.policy.guard.observe(num_seqs, tokens, ms, drafted)

    def finish(self, request_id: str) -> None:
        self.policy.tracker.forget(request_id)
        self.policy.windows.forget(request_id)
        self.judgements.forget(request_id)
        self.drafter.on_request_finish(request_id)


def verify(tree: DraftTree | None, output: list[int], done: int) -> list[int]:
    """What a request emits this step, its reference `output` emitted up to `done`: the model's
    token after each node of `tree` is the reference's (target-guided)."""

    def model_token(node: int | None) -> int | None:
        i = done + (0 if node is None or tree is None else tree.depths[node])
        return output[i] if i < len(output) else None

    return walk(tree, model_token)[0]

"""Speculation's settings: which drafter proposes trees, their shape, how many tokens they hold,
and the adaptive length's tuning values (`DraftConfig`; `config.EngineConfig` holds one)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from batchserve.settings import check_choice, setting

DraftMethod = Literal["none", "llma", "lookahead", "jacobi", "hybrid"]
DRAFT_METHODS: tuple[str, ...] = ("none", "llma", "lookahead", "jacobi", "hybrid")
TRIE_SCOPES: tuple[str, ...] = ("global", "tenant", "request")
DraftLayout = Literal["hierarchical", "parallel", "single"]
DRAFT_LAYOUTS: tuple[str, ...] = ("hierarchical", "parallel", "single")
LAYOUT_HELP = "lookahead: prefix-merged tree, disjoint chains, or one chain"
ADAPTIVE_DECODING_LENGTH = 64  # the default per-request cap when the policy chooses lengths
FIXED_DECODING_LENGTH = 16  # the default length when every request drafts the same


@dataclass(frozen=True, slots=True)
class DraftConfig:
    """Speculation: which drafter proposes trees, their shape and how many tokens they hold.

    `lookahead` is the trie of prompt and output n-grams (the Lookahead paper); `llma` copies
    a single branch from the request's own text; `jacobi` verifies n-grams that a Jacobi window
    of guessed tokens produces (Lookahead Decoding); `hybrid` merges the trie's tree with those
    n-grams; `none` decodes plainly.
    """

    method: DraftMethod = setting("lookahead", "draft source", name="draft", choices=DRAFT_METHODS)
    # Adaptive is the default everywhere: the policy never drafts what the device cannot verify
    # for free, so a busy server is never slower than plain decoding (benchmarks/README.md).
    adaptive: bool = setting(True, "choose each request's draft length every step from the cost profile and acceptance")
    # None resolves to 64 (the adaptive cap) or 16 (fixed) on construction.
    decoding_length: int | None = setting(
        None,
        f"draft tokens per request per step, root excluded: the cap when adaptive "
        f"(default {ADAPTIVE_DECODING_LENGTH}), else the length (default {FIXED_DECODING_LENGTH})",
    )
    profile_path: str | None = setting(
        None,
        "adaptive: cost profile JSON (default: the per-device cache, measured on first start)",
        flags=("--profile",),
    )
    acceptance_decay: float = setting(0.3, "adaptive: weight of the newest verification in the acceptance average")
    explore: float = setting(0.05, "adaptive: per idle step, how far a request's estimates drift back to the pool's")
    min_gain: float = setting(0.02, "adaptive: never draft a node accepted less often than this")
    # What the profile does not see: drafting's own bookkeeping, and a step's time swinging by a
    # tenth on a shared machine. A draft predicted to win by less is a coin toss that costs.
    min_speedup: float = setting(0.05, "adaptive: draft only where the step is predicted this much faster per token")
    # Off by default: on a shared machine a step's time swings by half, and the fit's cost of a
    # draft row then swings far from what a whole run measures (benchmarks/README.md). The speed
    # guard below checks the outcome instead.
    learn_step_costs: bool = setting(False, "adaptive: refine the cost profile from measured steps")
    # A trie lookup, no forward row: what the request then emits judges it as if verified.
    shadow_draft: int = setting(4, "adaptive: tokens proposed, not verified, for a request given none")
    # Each is a trie search and its judging: at 16 requests, 8 of them a step were a tenth of the
    # drafting's Python, paid in steps without drafts too (benchmarks/README.md). Past this many,
    # requests take turns.
    shadow_requests: int = setting(4, "adaptive: most requests given a shadow draft in one step")
    # Shadow drafts and plans cost host time in steps that verify no draft (speculation/host_budget.py).
    shadow_share: float = setting(0.02, "adaptive: where drafts are dormant, most of a step's time shadow drafts take")
    plan_backoff: int = setting(16, "adaptive: steps without drafts that make drafts dormant; the longest plan pause")
    # Optimistic enough that the first steps draft, so evidence arrives and the average takes over.
    initial_acceptance: float = setting(0.6, "adaptive: acceptance guessed for rank 0 before any evidence")
    # Rank j starts at 0.6 * 0.8**j: a deeper node needs every node above it accepted too.
    initial_acceptance_falloff: float = setting(0.8, "adaptive: ratio of each rank's first guess to the one above")
    # A quarter of a request's rate: one request's streak barely moves where new requests start.
    acceptance_pool_rate: float = setting(0.25, "adaptive: speed of the pooled prior relative to one request's")
    # About the last 1000 verified nodes: averages out luck, yet follows a new workload in seconds.
    calibration_decay: float = setting(0.999, "adaptive: per node, the weight the score calibration keeps")
    # Starts the fit as if it had seen ~20 nodes, so the first trees nudge it instead of swinging it.
    calibration_prior_strength: float = setting(20.0, "adaptive: the score calibration's Hessian floor")
    # A trie score of exactly 1 (a path seen once) maps to logit 6.9, not infinity.
    calibration_clip: float = setting(0.001, "adaptive: probabilities clip to [this, 1 - this] before a logit")
    # About the last 50 steps: enough to tell per-request from per-row cost, and follows load changes.
    step_cost_decay: float = setting(0.98, "adaptive: per step, the weight the step-cost fit keeps")
    # Tiny next to squared ms: only breaks ties between a slower machine and per-request cost.
    step_cost_ridge: float = setting(1.0, "adaptive: ridge penalty of the step-cost fit")
    # Beyond 4x either way the profile is wrong rather than the machine busy: recalibrate.
    step_cost_max_scale: float = setting(4.0, "adaptive: the fitted machine speed stays within this factor")
    # The policy's model checked against the outcome: steps with drafts must emit tokens at least
    # as fast as steps without, per batch size (speculation/speed_guard.py).
    speed_guard: bool = setting(True, "adaptive: draft less where steps with drafts measure slower than without")
    # One plain step in 17 costs a batch-1 run about 2% of its speculation gain (a quarter of that
    # while drafts win clearly), and keeps the baseline fresh as contexts grow.
    guard_period: int = setting(16, "adaptive: steps with drafts between two baseline steps without")
    guard_decay: float = setting(0.9, "adaptive: per step, the weight the guard's speed averages keep")
    # ln(hedge) moves by rate x (ratio - 1) per step: at 20% slower, about 10% more hedge a step.
    guard_rate: float = setting(0.5, "adaptive: how fast the guard's hedge follows the measured ratio")
    guard_max_hedge: float = setting(16.0, "adaptive: the most the guard divides a draft's expected gain by")
    layout: DraftLayout = setting("hierarchical", LAYOUT_HELP, name="draft_layout", choices=DRAFT_LAYOUTS)
    branch_length: int = setting(12, "lookahead: n-gram length inserted into the trie")
    # A request's own prompt and output are an indexed array searched when drafting: depth
    # costs nothing to index, and lets a request that copies its prompt draft further. Not 32: the
    # policy drafted rows past what they buy (HumanEval at batch 1 0.90x; benchmarks/README.md).
    own_branch_length: int = setting(12, "lookahead: longest path drafted from a request's own prompt and output")
    copy_chain: bool = setting(
        True, "lookahead: draft first what followed the longest earlier match (own text, recent outputs)"
    )
    # A request repeating an earlier answer copies it at any depth; 32k tokens: 128 KiB and their index.
    recent_output_tokens: int = setting(
        32768, "lookahead: tokens of finished outputs per scope a copy chain may draft from (0: none)"
    )
    max_match: int = setting(4, "longest suffix of the request's tokens tried as a match key")
    min_match: int = setting(1, "shortest suffix accepted as a match key")
    prompt_weight: float = setting(100.0, "lookahead: how much more a request's own n-grams count")
    # Per scope, so one tenant's traffic never decays another tenant's trie.
    trie_capacity: int = setting(200_000, "lookahead: output-trie nodes per scope before it decays and prunes")
    # 200k nodes are about 11-16 MB (arrays grow by doubling): the node cap binds first by default.
    trie_scope_bytes: int = setting(
        16 << 20, "lookahead: bytes one scope's output trie and recent outputs may hold; over it, it trims its own"
    )
    # One scope per tenant key: apps that send a key per end-user would otherwise grow without
    # bound. The drafter's shared state is at most trie_max_scopes x trie_scope_bytes (16 GiB).
    trie_max_scopes: int = setting(
        1024,
        "lookahead: output tries (tenant scopes) kept: a quarter for new scopes, the rest for proven ones"
        " (a second request ended); least recently used idle of each go",
    )
    warmup_path: str | None = setting(
        None,
        'lookahead: JSONL of earlier outputs ({"text"} or {"token_ids"}) to warm the trie with',
        flags=("--warmup",),
    )
    warmup_scope: str = setting("", "lookahead: the tenant key the warm-up corpus serves")
    trie_scope: str = setting(
        "tenant",
        "lookahead: who shares output n-grams: every request, requests with the same tenant key "
        "(requests without one share ''), or each request alone",
        choices=TRIE_SCOPES,
    )

    # Lookahead Decoding's (W, N, G). The paper used 15, 5, 15 for 7B models on an A100; a small
    # model on a CPU has far fewer spare FLOPs per step (benchmarks/README.md has the sweep).
    window_size: int = setting(5, "jacobi/hybrid: W, future positions the Jacobi window guesses at once")
    ngram_size: int = setting(4, "jacobi/hybrid: N, n-gram length (the window keeps N-1 levels)")
    guesses: int = setting(5, "jacobi/hybrid: G, pooled n-grams verified per request per step")
    pool_capacity: int = setting(100_000, "jacobi/hybrid: n-grams in all pools (the largest pool's oldest go first)")
    # Tokens per step a new request's window is assumed to buy before any evidence: optimistic
    # enough to run it, so the pool fills and the measured value takes over.
    window_initial_gain: float = setting(0.5, "jacobi/hybrid adaptive: a window's guessed worth in tokens per step")

    def __post_init__(self) -> None:
        if self.decoding_length is None:  # frozen: set the resolved default once, here
            default = ADAPTIVE_DECODING_LENGTH if self.adaptive else FIXED_DECODING_LENGTH
            object.__setattr__(self, "decoding_length", default)
        check_choice("draft method", self.method, DRAFT_METHODS)
        check_choice("draft layout", self.layout, DRAFT_LAYOUTS)
        check_choice("trie_scope", self.trie_scope, TRIE_SCOPES)
        if not 1 <= self.min_match <= self.max_match:
            raise ValueError(f"need 1 <= min_match <= max_match, got {self.min_match} and {self.max_match}")
        for name, ok, bounds in (
            ("decoding_length", self.decoding_length >= 0, ">= 0"),
            ("branch_length", self.branch_length >= 2, ">= 2"),
            ("own_branch_length", self.own_branch_length >= 2, ">= 2"),
            ("prompt_weight", self.prompt_weight > 0, "> 0"),
            ("shadow_draft", self.shadow_draft >= 0, ">= 0"),
            ("shadow_requests", self.shadow_requests >= 1, ">= 1"),
            ("shadow_share", 0 <= self.shadow_share <= 1, "in [0, 1]"),
            ("plan_backoff", self.plan_backoff >= 0, ">= 0"),
            ("trie_capacity", self.trie_capacity >= 1, ">= 1"),
            ("trie_scope_bytes", self.trie_scope_bytes >= 4096, ">= 4096"),
            ("trie_max_scopes", self.trie_max_scopes >= 1, ">= 1"),
            ("recent_output_tokens", self.recent_output_tokens >= 0, ">= 0"),
            ("acceptance_decay", 0 < self.acceptance_decay <= 1, "in (0, 1]"),
            ("explore", 0 <= self.explore <= 1, "in [0, 1]"),
            ("min_gain", 0 <= self.min_gain < 1, "in [0, 1)"),
            ("min_speedup", 0 <= self.min_speedup < 1, "in [0, 1)"),
            ("initial_acceptance", 0 < self.initial_acceptance <= 1, "in (0, 1]"),
            ("initial_acceptance_falloff", 0 < self.initial_acceptance_falloff <= 1, "in (0, 1]"),
            ("acceptance_pool_rate", 0 <= self.acceptance_pool_rate <= 1, "in [0, 1]"),
            ("calibration_decay", 0 < self.calibration_decay <= 1, "in (0, 1]"),
            ("calibration_prior_strength", self.calibration_prior_strength > 0, "> 0"),
            ("calibration_clip", 0 < self.calibration_clip < 0.5, "in (0, 0.5)"),
            ("step_cost_decay", 0 < self.step_cost_decay <= 1, "in (0, 1]"),
            ("step_cost_ridge", self.step_cost_ridge > 0, "> 0"),
            ("step_cost_max_scale", self.step_cost_max_scale >= 1, ">= 1"),
            ("guard_period", self.guard_period >= 1, ">= 1"),
            ("guard_decay", 0 <= self.guard_decay < 1, "in [0, 1)"),
            ("guard_rate", self.guard_rate > 0, "> 0"),
            ("guard_max_hedge", self.guard_max_hedge >= 1, ">= 1"),
        ):
            if not ok:
                raise ValueError(f"{name} must be {bounds}, got {getattr(self, name)}")
        for name, low in (("window_size", 1), ("ngram_size", 2), ("guesses", 0), ("pool_capacity", 1)):
            if getattr(self, name) < low:
                raise ValueError(f"{name} must be >= {low}, got {getattr(self, name)}")
        if self.window_initial_gain < 0:
            raise ValueError(f"window_initial_gain must be >= 0, got {self.window_initial_gain}")

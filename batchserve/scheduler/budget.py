"""Adaptive decoding length: how many draft tokens each request gets this step.

Pure Python. Two inputs:
- a `CostProfile`, measured once per device, dtype and model by `batchserve calibrate`:
  forward time against tokens in the step, at a few context lengths;
- an `AcceptanceTracker`: per request, an exponential moving average of how often the draft
  node at each rank (the drafter's k-th best node) ends up on the accepted path, pooled
  across requests as the prior for new ones. Where the drafter also scores its nodes (the
  trie's path frequency), a `ScoreCalibration` shared by all requests combines the two
  into one probability, so a step whose drafts the trie is sure of gets more tokens than
  one where it is guessing, beyond what the request's recent history says.

A node's estimate is exactly the expected number of extra tokens it buys, so the policy can
trade tokens against milliseconds:
1. Decode-only optimum: over all requests' draft nodes sorted by expected gain, the count k*
   maximising (roots + gain(k)) / time(roots + k). This is where extra tokens stop being
   nearly free, and it gives tau = time per token at that optimum.
2. With prefill chunks in the step (whose time is spent anyway) the same nodes are valued at
   tau each: the count maximising gain(k) * tau - time(tokens + k). Without prefill this is
   the same k* as step 1.
Nodes expected to be accepted less often than `min_gain` are never drafted, so a request whose
drafts keep failing gets none; while it gets none its estimates drift back toward the pooled
prior (`explore`), so it is retried once the batch has room again.
"""

from __future__ import annotations

import bisect
import heapq
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise linear; clamps below xs[0], extrapolates the last segment above xs[-1]."""
    if len(xs) == 1 or x <= xs[0]:
        return ys[0]
    i = min(bisect.bisect_right(xs, x), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True, slots=True)
class CostProfile:
    """Measured step time against tokens in the step (one sequence) at a few context lengths."""

    key: str  # device, dtype and model this was measured for
    token_counts: tuple[int, ...]  # ascending, tokens in the step
    contexts: tuple[int, ...]  # ascending, KV length each query token attends to
    step_ms: tuple[tuple[float, ...], ...]  # [context][token count] median milliseconds
    # [context] extra cost of each further request in a step: its own attention batch row,
    # the padding and gather of its KV, its metadata. Grows with context. Empty: none.
    per_seq_ms: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not self.token_counts or not self.contexts:
            raise ValueError("a cost profile needs at least one token count and one context")
        for name, xs in (("token_counts", self.token_counts), ("contexts", self.contexts)):
            if list(xs) != sorted(set(xs)) or xs[0] < 0:
                raise ValueError(f"{name} must be ascending and non-negative, got {xs}")
        if len(self.step_ms) != len(self.contexts) or any(len(r) != len(self.token_counts) for r in self.step_ms):
            raise ValueError("step_ms must be [len(contexts)][len(token_counts)]")
        if any(t <= 0 for row in self.step_ms for t in row) or any(t < 0 for t in self.per_seq_ms):
            raise ValueError("times must be positive")
        if self.per_seq_ms and len(self.per_seq_ms) != len(self.contexts):
            raise ValueError("per_seq_ms must have one entry per context")

    def curve(self, context: float = 0.0) -> list[float]:
        """Step time per `token_counts` entry at one context length (interpolated)."""
        return [
            _interp(self.contexts, [row[i] for row in self.step_ms], context) for i in range(len(self.token_counts))
        ]

    def time_ms(
        self, num_tokens: float, context: float = 0.0, num_seqs: int = 1, curve: list[float] | None = None
    ) -> float:
        """Predicted forward time of a step with `num_tokens` rows from `num_seqs` requests
        whose mean context is `context` (pass `curve(context)` to skip recomputing it)."""
        ys = curve if curve is not None else self.curve(context)
        return _interp(self.token_counts, ys, num_tokens) + self.seq_ms(context) * max(0, num_seqs - 1)

    def seq_ms(self, context: float = 0.0) -> float:
        """Cost of one more request in a step at this mean context."""
        return max(0.0, _interp(self.contexts, self.per_seq_ms, context)) if self.per_seq_ms else 0.0

    def critical_decoding_length(self, tolerance: float = 0.1, context: float | None = None) -> int:
        """The largest measured token count whose step costs at most (1 + tolerance) times a
        one-token step: up to here extra tokens are nearly free."""
        ctx = self.contexts[0] if context is None else context
        base = self.time_ms(1, ctx)
        cdl = 1
        for n in self.token_counts:
            if self.time_ms(n, ctx) <= (1 + tolerance) * base:
                cdl = max(cdl, n)
        return cdl

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> CostProfile:
        d = json.loads(text)
        return cls(
            key=str(d["key"]),
            token_counts=tuple(int(x) for x in d["token_counts"]),
            contexts=tuple(int(x) for x in d["contexts"]),
            step_ms=tuple(tuple(float(t) for t in row) for row in d["step_ms"]),
            per_seq_ms=_per_context(d.get("per_seq_ms", ()), len(d["contexts"])),
        )

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(self.to_json())
        tmp.replace(path)  # never leave a half-written profile behind

    @classmethod
    def load(cls, path: str | Path) -> CostProfile:
        try:
            return cls.from_json(Path(path).read_text())
        except (KeyError, TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not a batchserve cost profile ({e})") from None


def _per_context(value: Any, num_contexts: int) -> tuple[float, ...]:
    """Per-context costs; one number (older profiles) applies at every context."""
    if isinstance(value, (int, float)):
        return (float(value),) * num_contexts
    return tuple(float(x) for x in value)


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Solve a x = b for a small symmetric positive definite `a` (Gaussian elimination)."""
    n = len(b)
    m = [[*row, rhs] for row, rhs in zip(a, b)]
    for i in range(n):
        for k in range(i + 1, n):
            f = m[k][i] / m[i][i]
            for j in range(i, n + 1):
                m[k][j] -= f * m[i][j]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (m[i][n] - sum(m[i][j] * x[j] for j in range(i + 1, n))) / m[i][i]
    return x


def _nonnegative_ridge(xx: list[list[float]], xr: list[float], rr: float, nonneg: tuple[int, ...]) -> list[float]:
    """argmin |r - X beta|^2 + |beta|^2 with beta[i] >= 0 for i in `nonneg`, given the sums
    X^T X, X^T r and r^T r: the best of the unconstrained fits on every subset of free
    coefficients that keeps the signs (exact for these three coefficients)."""
    n = len(xr)
    best, best_obj = [0.0] * n, rr
    for mask in range(1, 1 << n):
        free = [i for i in range(n) if mask >> i & 1]
        sub = _solve([[xx[i][j] + (1.0 if i == j else 0.0) for j in free] for i in free], [xr[i] for i in free])
        if any(v < 0 for i, v in zip(free, sub) if i in nonneg):
            continue
        beta = [0.0] * n
        for i, v in zip(free, sub):
            beta[i] = v
        # |r - X beta|^2 + |beta|^2 from the sums.
        obj = rr - 2 * sum(beta[i] * xr[i] for i in range(n))
        obj += sum(beta[i] * (xx[i][j] + (1.0 if i == j else 0.0)) * beta[j] for i in range(n) for j in range(n))
        if obj < best_obj:
            best, best_obj = beta, obj
    return best


def _logit(p: float) -> float:
    p = min(1.0 - 1e-3, max(1e-3, p))
    return math.log(p / (1.0 - p))


class ScoreCalibration:
    """P(node accepted) = sigmoid(a * logit(rank estimate) + b * logit(drafter score) + c),
    fitted online to every verified node of every request.

    The drafter's score alone is far too confident (a trie continuation seen once has score
    1 and is accepted about a fifth of the time) and the rank estimate alone knows nothing
    about this step's match; together they predict better than either. The fit is a
    recursive Newton step with a decaying Hessian (about the last `1 / (1 - decay)` nodes),
    started at (1, 0, 0): until evidence arrives, the rank estimate is used as it is.
    """

    def __init__(self, decay: float = 0.999, prior_strength: float = 20.0) -> None:
        self.decay = decay
        self.prior_strength = prior_strength  # Hessian floor: how hard the first nodes move the fit
        self.weights = [1.0, 0.0, 0.0]
        self._hess = [[prior_strength if i == j else 0.0 for j in range(3)] for i in range(3)]

    def prob(self, rank_estimate: float, score: float) -> float:
        z = self.weights[0] * _logit(rank_estimate) + self.weights[1] * _logit(score) + self.weights[2]
        return 1.0 / (1.0 + math.exp(-max(-30.0, min(30.0, z))))

    def observe(self, rank_estimates: Sequence[float], scores: Sequence[float], hits: Sequence[bool]) -> None:
        """One verified tree: each node's rank estimate and score then, and whether it hit."""
        if not hits:
            return
        grad = [0.0] * 3
        hess = [[0.0] * 3 for _ in range(3)]
        for est, score, hit in zip(rank_estimates, scores, hits):
            x = (_logit(est), _logit(score), 1.0)
            p = self.prob(est, score)
            for i in range(3):
                grad[i] += (p - float(hit)) * x[i]
                for j in range(3):
                    hess[i][j] += p * (1.0 - p) * x[i] * x[j]
        d, floor = self.decay ** len(hits), self.prior_strength
        for i in range(3):
            for j in range(3):
                # The floor keeps the step bounded once old evidence has decayed away.
                self._hess[i][j] = d * self._hess[i][j] + hess[i][j] + (1.0 - d) * (floor if i == j else 0.0)
        step = _solve(self._hess, grad)
        self.weights = [w - s for w, s in zip(self.weights, step)]


def non_increasing(xs: Sequence[float]) -> list[float]:
    """The closest non-increasing sequence (pool adjacent violators): keeps the total gain of
    every prefix honest while letting the greedy take nodes in order."""
    blocks: list[list[float]] = []  # [mean, count]
    for x in xs:
        blocks.append([x, 1.0])
        while len(blocks) > 1 and blocks[-2][0] < blocks[-1][0]:
            m2, n2 = blocks.pop()
            m1, n1 = blocks[-1]
            blocks[-1] = [(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2]
    out: list[float] = []
    for m, n in blocks:
        out.extend([m] * int(n))
    return out


class AcceptanceTracker:
    """EMA per request and draft rank of "this node was on the accepted path"."""

    def __init__(self, max_rank: int, decay: float = 0.3, explore: float = 0.05) -> None:
        if max_rank < 1:
            raise ValueError(f"max_rank must be >= 1, got {max_rank}")
        self.decay = decay  # weight of the newest observation
        self.explore = explore  # pull toward the prior per step without a draft
        # Before any evidence: a geometric guess, optimistic enough that drafting starts.
        self.initial = [0.6 * 0.8**j for j in range(max_rank)]
        self.prior = list(self.initial)  # pooled over requests: where new requests start
        self.calibration = ScoreCalibration()  # for drafts whose nodes carry scores
        self._est: dict[str, list[float]] = {}
        self._gains: dict[str, list[float]] = {}  # non_increasing(_est[rid]), until the next observe

    def _monotone(self, request_id: str) -> list[float]:
        est = self._est.get(request_id)
        if est is None:
            return non_increasing(self.prior)  # the pool moves with every observation: not cached
        gains = self._gains.get(request_id)
        if gains is None:
            gains = self._gains[request_id] = non_increasing(est)
        return gains

    @property
    def max_rank(self) -> int:
        return len(self.prior)

    def gains(self, request_id: str, n: int, scores: Sequence[float] = ()) -> list[float]:
        """Expected extra tokens of the request's first `n` draft nodes, non-increasing.
        With the drafter's `scores` for those nodes, each is calibrated against its score."""
        if not scores:
            return self._monotone(request_id)[:n]
        ests = self._est.get(request_id, self.prior)[:n]
        return non_increasing([self.calibration.prob(e, sc) for e, sc in zip(ests, scores)])

    def upper_gains(self, request_id: str, n: int) -> list[float]:
        """The most the first `n` nodes could be worth whatever the drafter's scores turn out
        to be: what is worth proposing before the tree exists."""
        ests = self._est.get(request_id, self.prior)[:n]
        cal = self.calibration
        best_score = 1.0 if cal.weights[1] >= 0 else 0.0  # the fit is monotone in the score
        return [max(g, cal.prob(e, best_score)) for g, e in zip(self._monotone(request_id)[:n], ests)]

    def observe(
        self, request_id: str, num_offered: int, accepted_ranks: Iterable[int], scores: Sequence[float] = ()
    ) -> None:
        """Record one verification: ranks [0, num_offered) were drafted, `accepted_ranks` hit;
        `scores`: the drafter's score of each drafted node, if it gave them."""
        est = self._est.setdefault(request_id, list(self.prior))
        self._gains.pop(request_id, None)
        hits = set(accepted_ranks)
        n = min(num_offered, len(scores), self.max_rank)
        if n:  # calibrate against the estimates as they were when the draft was sized
            self.calibration.observe(est[:n], scores[:n], [j in hits for j in range(n)])
        a = self.decay
        for j in range(min(num_offered, self.max_rank)):
            x = 1.0 if j in hits else 0.0
            est[j] += a * (x - est[j])
            self.prior[j] += a * 0.25 * (x - self.prior[j])  # the pool moves slower than one request
        # Ranks not drafted drift back: the request's toward the pool's, and the pool's toward
        # the initial guess. Without the second, a streak of failures could silence every
        # request for good (no drafts, so no evidence that drafts would pay again).
        for j in range(num_offered, self.max_rank):
            est[j] += self.explore * (self.prior[j] - est[j])
            self.prior[j] += self.explore * 0.25 * (self.initial[j] - self.prior[j])

    def skipped(self, request_id: str) -> None:
        """The request sampled without a draft this step: drift toward the prior."""
        self.observe(request_id, 0, ())

    def forget(self, request_id: str) -> None:
        self._est.pop(request_id, None)
        self._gains.pop(request_id, None)


@dataclass(frozen=True, slots=True)
class DraftCandidate:
    """A request that samples this step and could carry up to `max_tokens` draft tokens."""

    request_id: str
    max_tokens: int
    scores: tuple[float, ...] = ()  # the drafter's score of each proposed node, if any


class DraftBudgetPolicy:
    """Chooses every sampling request's decoding length for one step (module docstring)."""

    def __init__(self, profile: CostProfile, tracker: AcceptanceTracker, min_gain: float = 0.02) -> None:
        self.profile = profile
        self.tracker = tracker
        self.min_gain = min_gain
        # Measured decode steps against the profile, fitted online as
        #   elapsed = scale * profile + per_seq * requests + per_token * rows.
        # `scale` absorbs the machine running uniformly faster or slower than when it was
        # calibrated (other load, clocks); it leaves every decision unchanged, because the
        # policy compares ratios. The two overheads are engine work the forward-only profile
        # does not see (scheduling, drafting, detokenizing); they do move decisions.
        self.scale = 1.0
        self.overhead_per_seq_ms = 0.0
        self.overhead_per_token_ms = 0.0
        self._xx = [[0.0] * 3 for _ in range(3)]  # decayed sums of x x^T, x = (profile, seqs, tokens)
        self._xr = [0.0] * 3  # decayed sums of x * (elapsed - profile)
        self._rr = 0.0  # decayed sum of (elapsed - profile)^2

    def useful_length(self, request_id: str, limit: int) -> int:
        """How many of the request's best draft ranks clear `min_gain`: the most it could be
        given, so there is no point in proposing more."""
        return sum(1 for g in self.tracker.upper_gains(request_id, limit) if g >= self.min_gain)

    def observe_step(self, num_tokens: int, context: float, num_seqs: int, elapsed_ms: float) -> None:
        """Record a measured decode step (schedule + forward + update; no prompt chunks)."""
        if num_tokens < 1 or num_seqs < 1:
            return
        predicted = self.profile.time_ms(num_tokens, context, num_seqs)
        x = (predicted, float(num_seqs), float(num_tokens))
        r = elapsed_ms - predicted
        d = 0.98  # about the last 50 steps
        self._rr = d * self._rr + r * r
        for i in range(3):
            self._xr[i] = d * self._xr[i] + x[i] * r
            for j in range(3):
                self._xx[i][j] = d * self._xx[i][j] + x[i] * x[j]
        # Ridge least squares toward (scale 1, no overhead), overheads never negative. Where
        # the data cannot tell a slower machine from per-request cost (every step the same
        # size), the smallest coefficients win: a scale explains a uniform slowdown with the
        # smallest one.
        beta = _nonnegative_ridge(self._xx, self._xr, self._rr, nonneg=(1, 2))
        self.scale = min(4.0, max(0.25, 1.0 + beta[0]))
        self.overhead_per_seq_ms, self.overhead_per_token_ms = beta[1], beta[2]

    def allocate(
        self,
        candidates: Sequence[DraftCandidate],
        *,
        num_roots: int,
        num_other_tokens: int = 0,
        context: float = 0.0,
        num_seqs: int | None = None,
        token_budget: int | None = None,
    ) -> dict[str, int]:
        """`num_roots`: requests emitting a token this step (with or without a draft);
        `num_other_tokens`: the step's other rows (prefill chunks, fixed-length drafts);
        `context`: mean KV length of the step's rows; `token_budget`: most draft tokens."""
        num_seqs = num_seqs if num_seqs is not None else max(1, num_roots)
        cap = token_budget if token_budget is not None else sum(c.max_tokens for c in candidates)
        # Each request's gains are non-increasing, so merging them in descending order takes
        # every request's nodes as a prefix.
        per_req = [
            [(g, c.request_id) for g in self.tracker.gains(c.request_id, c.max_tokens, c.scores) if g >= self.min_gain]
            for c in candidates
        ]
        ranked = list(heapq.merge(*per_req, key=lambda x: -x[0]))[: max(0, cap)]
        gain = [0.0]
        for g, _ in ranked:
            gain.append(gain[-1] + g)

        curve = self.profile.curve(context)

        overhead = self.overhead_per_seq_ms * num_seqs

        def cost(extra: int, others: int) -> float:
            rows = num_roots + others + extra
            forward = self.scale * self.profile.time_ms(rows, context, num_seqs, curve)
            return forward + overhead + self.overhead_per_token_ms * rows

        # 1. Decode-only optimum and the value of a token there.
        best_k = max(range(len(gain)), key=lambda k: ((num_roots + gain[k]) / cost(k, 0), -k))
        tau = cost(best_k, 0) / max(1e-9, num_roots + gain[best_k])
        # 2. The rest of the step's rows are paid for anyway: value nodes at tau each.
        if num_other_tokens > 0:
            best_k = max(range(len(gain)), key=lambda k: (gain[k] * tau - cost(k, num_other_tokens), -k))
        lengths = {c.request_id: 0 for c in candidates}
        for _, rid in ranked[:best_k]:
            lengths[rid] += 1
        return lengths

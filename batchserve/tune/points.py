"""`batchserve tune`'s records and choices: the goals, the measured points, the result, which
point to recommend (or, when none meets the goals, which comes closest), and a point's line."""

from __future__ import annotations

from dataclasses import dataclass, field

DRAFTS = ("none", "lookahead-adaptive")  # what a point runs: no drafts, or adaptive lookahead drafts
SERVE_FLAGS = {"none": "--draft none", "lookahead-adaptive": "--draft lookahead --adaptive"}


@dataclass(frozen=True, slots=True)
class Goals:
    """Latency goals at a percentile of requests (None: no goal on that one)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    percentile: float = 99.0

    def __post_init__(self) -> None:
        if not 0 < self.percentile <= 100:
            raise ValueError(f"percentile must be in (0, 100], got {self.percentile}")
        for name, v in (("TTFT", self.ttft_ms), ("TPOT", self.tpot_ms)):
            if v is not None and v <= 0:
                raise ValueError(f"the {name} goal must be > 0 ms, got {v}")

    def missed(self, ttft_ms: float, tpot_ms: float) -> str:
        """Which goals a point misses ('' when it meets them all)."""
        p = f"p{self.percentile:g}"
        out = []
        if self.ttft_ms is not None and ttft_ms > self.ttft_ms:
            out.append(f"TTFT {p} {ttft_ms:.0f} > {self.ttft_ms:g} ms")
        if self.tpot_ms is not None and tpot_ms > self.tpot_ms:
            out.append(f"TPOT {p} {tpot_ms:.1f} > {self.tpot_ms:g} ms")
        return "; ".join(out)


@dataclass(slots=True)
class Point:
    draft: str  # one of DRAFTS
    max_num_seqs: int
    max_num_batched_tokens: int
    tokens_per_s: float
    ttft_ms: float  # at the goals' percentile
    tpot_ms: float
    tokens_per_step: float
    lossless: bool | None = None  # with drafts: outputs equal `none`'s at the same concurrency
    missed: str = ""  # the goals it misses
    weights: str = ""  # the CPU weights it ran ("gguf", "bfloat16", "float32"; "": not recorded)

    @property
    def meets(self) -> bool:
        return not self.missed

    def serve_flags(self) -> str:
        flags = (
            f"--max-num-seqs {self.max_num_seqs} --max-num-batched-tokens {self.max_num_batched_tokens} "
            f"{SERVE_FLAGS[self.draft]}"
        )
        return flags + (f" --cpu-weights {self.weights}" if self.weights else "")


@dataclass(slots=True)
class TuneResult:
    goals: Goals
    points: list[Point] = field(default_factory=list)
    best: Point | None = None
    confirmed_tokens_per_s: float | None = None  # --confirm: the recommendation measured again

    @property
    def confirm_ratio(self) -> float | None:
        if self.best is None or self.confirmed_tokens_per_s is None:
            return None
        return self.confirmed_tokens_per_s / self.best.tokens_per_s


def recommend(points: list[Point]) -> Point | None:
    """The point with the most tokens/s among those that meet the goals (ties: fewer seats)."""
    ok = [p for p in points if p.meets]
    return max(ok, key=lambda p: (p.tokens_per_s, -p.max_num_seqs)) if ok else None


def closest(points: list[Point], goals: Goals) -> Point | None:
    """When nothing meets the goals: the point that misses them by the least (relative)."""

    def excess(p: Point) -> float:
        over = 0.0
        if goals.ttft_ms is not None:
            over = max(over, p.ttft_ms / goals.ttft_ms)
        if goals.tpot_ms is not None:
            over = max(over, p.tpot_ms / goals.tpot_ms)
        return over

    return min(points, key=excess) if points else None


def format_point(p: Point) -> str:
    verdict = "meets the goals" if p.meets else p.missed
    return (
        f"{p.draft:18} seqs={p.max_num_seqs:<3} budget={p.max_num_batched_tokens:<5} "
        f"{p.tokens_per_s:7.1f} tok/s  TTFT {p.ttft_ms:7.0f} ms  TPOT {p.tpot_ms:6.1f} ms  "
        f"{p.tokens_per_step:4.2f} tok/step  {verdict}"
    )

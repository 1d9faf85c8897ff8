"""`batchserve bench --shape NAME --curve-out DIR`: a random-weight model of a size users run
(`shapes.py`), timed on this device.

Writes under DIR:
- curve.json: what a step costs on this model and device, measured by the engine's own
  calibration (`runner/calibrate.py`) on the engine's own runner (`host.measure_curve`): `profile`,
  the `CostProfile` the adaptive policy reads (ms per step by rows of one request computing its
  token and a chain draft, at each context, and what each further request and draft row adds), and
  `decode_ms`, steps of n requests computing one token each (plain decoding at n in flight).
  `batchserve bench --simulate --curve DIR/curve.json` predicts tokens/s of `none` and
  `lookahead-adaptive` from it;
- results.json and report.md: decode TPOT of our `none` engine against the `hf-static` peer (HF
  `generate` with a static cache and a compiled forward) over the same weight tensors, random prompt
  ids, one prompt at a time (both run batch 1).

`load_curve` reads such a file (or any cost profile JSON, or a bare `{"rows", "ms"}` curve), and
`synthetic_profile` is a made-up curve for tests.
"""

from __future__ import annotations

import gc
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from batchserve.bench.host import measure_curve
from batchserve.bench.shapes import ModelShape, build_model, hf_twin, random_prompts, synthetic_tokenizer
from batchserve.cost_profile import CostProfile

ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # rows a step computes: one request's, or n requests' one each
CONTEXTS = (128, 512)  # KV tokens each request attends to: a few hundred, as a chat or code prompt
REPEATS = 9  # timings per step shape (calibrate's lower quartile of them)
PROMPT_TOKENS = 128  # each TPOT prompt's length
DATASET = "random-ids"  # the rows' dataset: random prompt ids
PEER = "hf-static"
SYNTHETIC = "synthetic"  # --curve's name for `synthetic_profile`


@dataclass(frozen=True, slots=True)
class ShapeRun:
    """What `run_shape` wrote, for the command's last lines."""

    curve: dict[str, Any]  # curve.json's content
    rows: list[Any]  # results.json's rows (`methods.Row`)
    report: str  # report.md's text


def curve_engine(model: Any, tokenizer: Any, rows: tuple[int, ...], contexts: tuple[int, ...]) -> Any:
    """An offline engine over `model` whose pool holds the largest decode step measured (max(rows)
    requests at the longest context) and whose step buckets (CUDA graphs on a GPU) hold up to
    max(rows) rows and requests: every measured step runs as a served one would."""
    from batchserve import LLM
    from batchserve.config import CacheConfig

    block_size = CacheConfig().block_size
    most = max(rows)
    blocks = most * -(-(max(contexts) + 2) // block_size) + 64  # + calibrate's few spare requests
    return LLM(
        draft="none",
        max_num_seqs=most,
        max_num_batched_tokens=max(most, 16),
        num_blocks=blocks,
        hf_model=model,
        tokenizer=tokenizer,
    )


def load_curve(path: str | Path) -> CostProfile:
    """The cost profile in a curve file: curve.json (its `profile`), a cost profile's own JSON
    (`batchserve calibrate` writes one), or `{"rows": [...], "ms": [...]}` (one context); or the
    synthetic curve for `synthetic`. ValueError saying what is wrong otherwise."""
    if str(path) == SYNTHETIC:
        return synthetic_profile()
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read the curve {path}: {e}") from None
    if isinstance(data, dict) and isinstance(data.get("profile"), dict):
        data = data["profile"]
    try:
        if isinstance(data, dict) and "token_counts" in data:
            return CostProfile.from_json(json.dumps(data))
        if isinstance(data, dict) and "rows" in data and "ms" in data:
            rows, ms = [int(r) for r in data["rows"]], [float(t) for t in data["ms"]]
            if len(rows) != len(ms):
                raise ValueError("rows and ms differ in length")
            key = str(data.get("key", Path(path).stem))
            return CostProfile(key, tuple(rows), (int(data.get("context", 0)),), (tuple(ms),))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: not a cost curve ({e})") from None
    raise ValueError(f"{path}: not a cost curve (curve.json, a cost profile, or {{'rows': [...], 'ms': [...]}})")


def synthetic_profile(base_ms: float = 8.0, knee: int = 64, context: int = 256) -> CostProfile:
    """A made-up curve shaped as a large model's on a GPU: flat at `base_ms` (reading the weights)
    up to `knee` rows, then linear in the rows (compute-bound); no per-request or per-draft-row
    cost. For tests and a first look: never a measurement."""
    if knee < 1 or base_ms <= 0:
        raise ValueError("knee must be >= 1 and base_ms > 0")
    rows = sorted({1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, knee})
    ms = tuple(base_ms * max(1.0, r / knee) for r in rows)
    return CostProfile(f"synthetic-{base_ms:g}ms-knee{knee}", tuple(rows), (context,), (ms,), (0.0,), 1, (0.0,))


def tpot_rows(
    model: Any,
    tokenizer: Any,
    prompts: list[list[int]],
    max_new: int,
    peer: str = PEER,
) -> list[Any]:
    """Our `none` engine, then the peer (`hf-static`, or `hf`: plain `generate`), each one prompt
    at a time over the same weights: their rows, the `none` row counting the prompts whose
    output equals the peer's (`reference_matches`: bf16 kernels round differently, so this
    says how alike they are, not losslessness)."""
    from batchserve.bench.methods import batchserve_method, make_row
    from batchserve.bench.peers import run_hf
    from batchserve.bench.runs import run_batchserve

    none = batchserve_method("none")
    assert none is not None
    run = run_batchserve(model, tokenizer, prompts, max_new, 1, none, [], 16)
    ours = make_row("none", DATASET, 1, run.outputs, run.seconds, run.ttfts, run.tpots, run.tokens_per_step, None)
    run.phases.apply(ours)
    gc.collect()
    hf = hf_twin(model)
    outs, secs, ttfts, tpots = run_hf(hf, prompts, max_new, 0, None, f"{DATASET} {peer}", static=peer == PEER)
    theirs = make_row(peer, DATASET, 1, outs, secs, ttfts, tpots, 1.0, None)
    ours.reference_matches = sum(a == b for a, b in zip(run.outputs, outs))
    return [ours, theirs]


def run_shape(
    shape: ModelShape,
    out_dir: Path,
    num_prompts: int,
    max_new: int,
    device: str | None = None,
    rows: tuple[int, ...] = ROWS,
    contexts: tuple[int, ...] = CONTEXTS,
    repeats: int = REPEATS,
    peer: str = PEER,
    progress: bool = True,
) -> ShapeRun:
    """Build `shape` on `device` (default: CUDA where there is one), write curve.json, then
    results.json and report.md (module docstring)."""
    import torch

    from batchserve.bench.report import save_results

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model = build_model(shape, device)
    if model.embed_tokens.weight.is_cuda:
        torch.cuda.synchronize()
    built_s = time.perf_counter() - t0
    tokenizer = synthetic_tokenizer(shape.vocab_size)
    llm = curve_engine(model, tokenizer, rows, contexts)
    on = next(model.parameters()).device  # the engine runs where its model's weights are
    curve = {
        "shape": asdict(shape),
        "num_params": shape.num_params,
        "kv_bytes_per_token": shape.kv_bytes_per_token(next(model.parameters()).element_size()),
        "device": str(on) + _device_name(on),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "forward": llm.engine.facts.forward.line(),
        "build_seconds": round(built_s, 2),
        **measure_curve(llm, rows, contexts, repeats, progress),
    }
    (out_dir / "curve.json").write_text(json.dumps(curve, indent=1))
    del llm
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    prompts = random_prompts(shape.vocab_size, num_prompts, min(PROMPT_TOKENS, shape.max_position_embeddings // 4))
    results = tpot_rows(model, tokenizer, prompts, max_new, peer)
    save_results(results, out_dir)
    report = report_text(curve, results, out_dir)
    (out_dir / "report.md").write_text(report)
    return ShapeRun(curve, results, report)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _device_name(device: Any) -> str:
    import torch

    return f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""


def report_text(curve: dict[str, Any], rows: list[Any], out_dir: Path) -> str:
    """report.md: the model, its cost curve (measured, and the profile's prediction for the
    decode steps beside them), and the TPOT comparison."""
    profile = CostProfile.from_json(json.dumps(curve["profile"]))
    lines = _model_lines(curve) + _cost_lines(curve, profile) + _tpot_lines(curve, rows)
    lines += [
        "",
        "Predicted tokens/s of `none` and `lookahead-adaptive` from this curve: "
        f"`batchserve bench --simulate --curve {out_dir / 'curve.json'}`",
        "",
    ]
    return "\n".join(lines)


def _model_lines(curve: dict[str, Any]) -> list[str]:
    """report.md's title and the model: its size, shape, build time and forward."""
    shape = curve["shape"]
    return [
        f"# {shape['name']} with random weights on {curve['device']}",
        "",
        f"{_count(curve['num_params'])} parameters in {curve['dtype']} (hidden {shape['hidden_size']}, "
        f"{shape['num_hidden_layers']} layers, {shape['num_attention_heads']} query / "
        f"{shape['num_key_value_heads']} KV heads of {shape['head_dim']}, MLP {shape['intermediate_size']}, "
        f"vocab {shape['vocab_size']}; {curve['kv_bytes_per_token'] / 1024:g} KiB of KV per token), built on the "
        f"device in {curve['build_seconds']} s.",
        "",
        f"Forward: {curve['forward']}",
        "",
    ]


def _cost_lines(curve: dict[str, Any], profile: CostProfile) -> list[str]:
    """report.md's step cost table (one request, decode, the profile's decode, by rows and
    context) and each context's further-request and draft-row costs."""
    lines = [
        "## Step cost (ms), by rows",
        "",
        "One request: its token and a chain draft of rows - 1 (the curve the adaptive policy reads). "
        "Decode: that many requests, one row each (plain decoding at that many in flight); `profile` is "
        "what the cost profile predicts for that decode step.",
        "",
    ]
    header = ["rows"]
    for c in profile.contexts:
        header += [f"one request, ctx {c}", f"decode, ctx {c}", f"profile, ctx {c}"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for i, n in enumerate(curve["rows"]):
        cells = [str(n)]
        for j, c in enumerate(profile.contexts):
            one = profile.step_ms[j][profile.token_counts.index(n)] if n in profile.token_counts else None
            decode = curve["decode_ms"].get(str(c), [])
            cells += [
                "-" if one is None else f"{one:.2f}",
                f"{decode[i]:.2f}" if i < len(decode) else "-",
                f"{profile.time_ms(n, c, n):.2f}",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for c in profile.contexts:
        lines.append(
            f"- ctx {c}: each further request +{profile.seq_ms(c):.3f} ms, each draft row among several requests "
            f"+{profile.draft_row_ms(c):.3f} ms, critical decoding length {profile.critical_decoding_length(context=c)}"
        )
    return lines


def _tpot_lines(curve: dict[str, Any], rows: list[Any]) -> list[str]:
    """report.md's TPOT comparison of `none` (rows[0]) and the peer (rows[-1])."""
    lines = ["", "## Decode TPOT, one prompt at a time, same weights", ""]
    lines += ["| method | TPOT p50 (ms) | TPOT p99 (ms) | TTFT p50 (ms) | tokens/s | prompts x tokens |"]
    lines.append("|---|---|---|---|---|---|")
    for r in rows:
        lines.append(
            f"| {r.method} | {r.tpot_p50_s * 1e3:.2f} | {r.tpot_p99_s * 1e3:.2f} | {r.ttft_p50_s * 1e3:.1f} | "
            f"{r.tokens_per_s} | {r.num_prompts} x {r.output_tokens // max(1, r.num_prompts)} |"
        )
    ours, peer = rows[0], rows[-1]
    if peer.tpot_p50_s > 0:
        lines += ["", f"`none` TPOT / `{peer.method}` TPOT (p50): {ours.tpot_p50_s / peer.tpot_p50_s:.3f}"]
    lines.append(
        f"Outputs identical to the peer's: {ours.reference_matches} of {ours.num_prompts} (random weights in "
        f"{curve['dtype']}: different kernels may flip near-ties, so this is a likeness, not a check)."
    )
    return lines

"""`batchserve bench --shape` and `bench --simulate --curve`: their checks, what they run and print."""

from __future__ import annotations

import argparse
import sys

from batchserve.bench.shapes import SHAPES

PREDICT_IN_FLIGHT = [1, 2, 4, 8, 16, 32, 64]
SYNTHETIC_CURVE = "synthetic"  # --curve's name for the made-up curve (bench/curve.py's SYNTHETIC)


def add_curve_flags(bench: argparse.ArgumentParser) -> None:
    """`bench`'s --curve, --shape and --curve-out."""
    bench.add_argument(
        "--curve",
        default=None,
        help="--simulate: predict none and lookahead-adaptive tokens/s at each --batch-sizes in flight from the "
        "replayed acceptance and this step cost curve (a --curve-out curve.json, a cost profile JSON, or "
        f"'{SYNTHETIC_CURVE}': a made-up GPU-like curve)",
    )
    bench.add_argument(
        "--shape",
        default=None,
        help=f"build a random-weight model of this shape on the GPU ({', '.join(SHAPES)}; the tiny one runs on a CPU), "
        "measure its step cost curve and decode TPOT of none against hf-static (--num-prompts random prompts, "
        "--max-new-tokens each); writes curve.json, results.json and report.md under --curve-out",
    )
    bench.add_argument("--curve-out", default=None, help="--shape: the output directory (default: --out)")


def shape_problem(args: argparse.Namespace) -> str | None:
    """Why `--shape` cannot run here (checked before anything is built), else None."""
    import torch

    from batchserve.bench.shapes import get_shape

    if args.simulate or args.ceiling or args.curve is not None:
        return "--shape measures a model on this device; --simulate --curve predicts from what it wrote: run them apart"
    try:
        shape = get_shape(args.shape)
    except ValueError as e:
        return str(e)
    if min(args.num_prompts, args.max_new_tokens) < 1:
        return "--num-prompts and --max-new-tokens must be >= 1"
    if not shape.cpu_ok and not torch.cuda.is_available():
        tiny = ", ".join(s.name for s in SHAPES.values() if s.cpu_ok)
        return (
            f"--shape {shape.name} builds {shape.num_params / 1e9:.1f}B parameters "
            f"({2 * shape.num_params / 1e9:.1f} GB in bfloat16) on a CUDA device, and torch sees none here; "
            f"--shape {tiny} runs the same path on the CPU"
        )
    return None


def shape_command(args: argparse.Namespace) -> int:
    """`bench --shape NAME`: refuse what cannot run here (exit 2), else measure the shape and
    write curve.json, results.json and report.md under --curve-out (or --out)."""
    from pathlib import Path

    from batchserve.bench.curve import run_shape
    from batchserve.bench.shapes import get_shape

    problem = shape_problem(args)
    if problem is not None:
        print(f"batchserve bench: {problem}", file=sys.stderr)
        return 2
    out = Path(args.curve_out or args.out)
    run = run_shape(get_shape(args.shape), out, args.num_prompts, args.max_new_tokens)
    print(run.report)
    print(f"wrote {out / 'curve.json'}, {out / 'results.json'}, {out / 'report.md'}")
    return 0


def predict_command(args: argparse.Namespace, datasets: list[str]) -> int:
    """`bench --simulate --curve FILE`: predicted tokens/s at each --batch-sizes in flight (default
    `PREDICT_IN_FLIGHT`); exit 2 on bad counts or a curve that cannot be read."""
    from batchserve.bench import predict
    from batchserve.bench.curve import load_curve

    in_flight = args.batch_sizes if args.batch_sizes is not None else PREDICT_IN_FLIGHT
    if not in_flight or min(args.num_samples, args.max_new_tokens, *in_flight) < 1:
        print("batchserve bench: --num-samples, --max-new-tokens and --batch-sizes must be >= 1", file=sys.stderr)
        return 2
    try:
        profile = load_curve(args.curve)
    except ValueError as e:
        print(f"batchserve bench: --curve: {e}", file=sys.stderr)
        return 2
    predict.main(datasets, in_flight, args.num_samples, args.model, profile, args.max_new_tokens)
    return 0

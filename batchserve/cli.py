"""The `batchserve` command line."""

from __future__ import annotations

import argparse
import sys


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batchserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="benchmarks")
    bench.add_argument("--simulate", action="store_true", help="drafters' step compression, no model run")
    bench.add_argument("--dataset", default="humaneval,sharegpt", help="humaneval, sharegpt or both (comma-separated)")
    bench.add_argument("--decoding-lengths", type=_ints, default=[4, 8, 16, 32, 64])
    bench.add_argument("--num-samples", type=int, default=164, help="samples per dataset (half dev, half test)")
    bench.add_argument("--model", default=None, help="model whose tokenizer to use (default: SmolLM2)")
    bench.add_argument("--no-speed", action="store_true", help="skip the trie timing and memory measurement")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        if not args.simulate:
            print("batchserve bench: only --simulate is available so far", file=sys.stderr)
            return 2
        datasets = [d.strip() for d in args.dataset.split(",") if d.strip()]
        unknown = set(datasets) - {"humaneval", "sharegpt"}
        if unknown:
            print(f"batchserve bench: unknown dataset(s) {sorted(unknown)}", file=sys.stderr)
            return 2
        from benchmarks.simulate import main as simulate_main

        simulate_main(datasets, args.decoding_lengths, args.num_samples, args.model, speed=not args.no_speed)
    return 0


if __name__ == "__main__":
    sys.exit(main())

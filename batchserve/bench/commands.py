"""The `batchserve bench` and `batchserve plot` commands: their flags and what they run."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from batchserve.bench.curve_commands import add_curve_flags, predict_command, shape_command
from batchserve.config import MODEL_DTYPES

BENCH_BATCH_SIZES = [1, 2, 4, 8, 16]


def int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def float_list(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def add_bench_parser(sub: Any) -> None:
    bench = sub.add_parser("bench", help="benchmarks against peers (or --simulate: drafts without the model)")
    bench.add_argument(
        "--dataset",
        default="humaneval,sharegpt",
        help="comma-separated: humaneval, sharegpt, sharegpt-multiturn (second turns after their first), "
        "system-prompt (short questions behind one shared ~400-token system prompt), code-edit (edit a "
        "standard-library function), doc-qa (a question on a documentation section), summarize, or FILE.jsonl "
        'of your own prompts ({"prompt": ...} or {"messages": [...]} per line)',
    )
    bench.add_argument("--model", default=None, help="model (default: SmolLM2)")
    bench.add_argument("--num-prompts", type=int, default=16, help="test prompts per dataset (at least)")
    bench.add_argument(
        "--waves",
        type=int,
        default=0,
        help="batch b runs at least waves*b prompts, so the closed loop stays full (0: --num-prompts for all)",
    )
    bench.add_argument(
        "--batch-sizes",
        type=int_list,
        default=None,
        help="requests in flight (default 1,2,4,8,16; with --simulate --curve 1,2,4,8,16,32,64)",
    )
    bench.add_argument(
        "--request-rates",
        type=float_list,
        default=[],
        help="also an open loop per rate: Poisson arrivals, requests/s, at most max(--batch-sizes) running",
    )
    bench.add_argument(
        "--methods",
        default="hf,hf-prompt-lookup,hf-batch,none,llma,parallel,lookahead",
        help="comma-separated: hf, hf-static (static cache + compiled forward), hf-prompt-lookup, hf-batch, "
        "llamacpp (llama-cpp-python on the same GGUF, batch 1), none, llma, parallel, lookahead, lookahead-cold, "
        "lookahead-4|16|64, lookahead-adaptive (and -blas / -hf / -native variants: torch's BLAS / the "
        "transformers forward / ours even where auto would not take it), "
        "jacobi, hybrid (and jacobi-W-N / hybrid-W-N: that window, G = W; "
        "jacobi-4|16|64 / hybrid-4|16|64: the window every step); "
        "a batchserve method without -gguf / -bf16 / -f32 runs the weights `make serve` runs here (printed); "
        "a batchserve method with the suffix +nocache runs with prefix caching off, with +logprobs each "
        "request asks for its tokens' logprobs (top 5), with +prediction each sends its sample's prediction",
    )
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--decoding-length", type=int, default=16, help="draft tokens per step of the fixed methods")
    _add_repeat_flags(bench)
    bench.add_argument("--dtype", default="float32", choices=MODEL_DTYPES)
    bench.add_argument(
        "--allow-mismatch", action="store_true", help="fp16/bf16: report outputs that differ from HF, do not fail"
    )
    bench.add_argument("--out", default="bench_out", help="directory for results.json, report.md, throughput.png")
    _add_replay_flags(bench)
    add_curve_flags(bench)
    _add_gguf_flags(bench)


def _add_repeat_flags(bench: argparse.ArgumentParser) -> None:
    """How often each row runs, which run it reports, and what proves the hf-static peer fast."""
    bench.add_argument("--repeats", type=int, default=1, help="runs per batchserve method and batch, in rounds")
    bench.add_argument(
        "--keep", default="fastest", choices=["fastest", "median"], help="which of the repeated runs is reported"
    )
    bench.add_argument("--peer-repeats", type=int, default=1, help="runs of hf-static (its row: the --keep one)")
    bench.add_argument(
        "--hf-static-max-ms",
        type=float,
        default=None,
        help="hf-static's row fails above this decode ms a token (default: 10 on CUDA, none on a CPU)",
    )


def _add_gguf_flags(bench: argparse.ArgumentParser) -> None:
    """--write-gguf and its --quant, --seed (with --shape): a random-block GGUF, no benchmark."""
    bench.add_argument(
        "--write-gguf",
        default=None,
        metavar="PATH",
        help="write --shape as a llama.cpp GGUF file in --quant, random blocks and the default model's tokenizer",
    )
    bench.add_argument(
        "--quant",
        default="Q4_K_M",
        help="--write-gguf: llama-quantize's mix Q4_K_M, Q5_K_M, Q6_K, Q8_0, Q4_0, Q4_1, Q5_0 or Q5_1; "
        "Q4_K, Q5_K (pure), F16, BF16 or F32",
    )
    bench.add_argument("--seed", type=int, default=0, help="--write-gguf: the random blocks' seed")


def _add_replay_flags(bench: argparse.ArgumentParser) -> None:
    """The flags of the replays that run no benchmark: --simulate, --ceiling and theirs."""
    bench.add_argument("--simulate", action="store_true", help="drafters' step compression, no model run")
    bench.add_argument(
        "--ceiling",
        action="store_true",
        help="the model's greedy outputs replayed through the trie (with predictions where given) and two copiers",
    )
    bench.add_argument(
        "--decoding-lengths", type=int_list, default=[4, 8, 16, 32, 64], help="--simulate and --ceiling only"
    )
    bench.add_argument("--num-samples", type=int, default=164, help="--simulate: samples per dataset (half dev)")
    bench.add_argument("--no-speed", action="store_true", help="--simulate: skip the trie timing and memory")


def dataset_problem(datasets: list[str]) -> str | None:
    """Why these datasets cannot run (unknown, or a JSONL file with a bad line), else None:
    checked before any model loads."""
    from batchserve.bench.datasets import DATASETS, DatasetError, is_jsonl, jsonl, known_dataset

    unknown = [d for d in datasets if not known_dataset(d)]
    if unknown or not datasets:
        return f"unknown dataset(s) {unknown}: a name of {', '.join(DATASETS)} (+repeat: twice) or a .jsonl file"
    for d in filter(is_jsonl, datasets):
        try:
            jsonl(d.removesuffix("+repeat"))
        except DatasetError as e:
            return str(e)
    return None


def _bench_problem(args: argparse.Namespace, methods: list[str]) -> str | None:
    from batchserve.bench import METHODS
    from batchserve.bench.methods import known_method

    bad = [m for m in methods if not known_method(m)]
    if bad or not methods:
        return f"unknown method(s) {bad}; choose from {', '.join(METHODS)}"
    counts = (args.num_prompts, args.max_new_tokens, args.repeats, args.peer_repeats, *args.batch_sizes)
    if min(counts) < 1 or args.waves < 0 or not args.batch_sizes or any(r <= 0 for r in args.request_rates):
        return (
            "--num-prompts, --max-new-tokens, --repeats, --peer-repeats and --batch-sizes must be >= 1, "
            "--waves >= 0, --request-rates > 0"
        )
    if args.hf_static_max_ms is not None and not args.hf_static_max_ms > 0:
        return "--hf-static-max-ms must be > 0"
    return None


def _ceiling_problem(args: argparse.Namespace) -> str | None:
    if args.simulate:
        return "--ceiling and --simulate are two different replays: choose one"
    if not args.decoding_lengths or min(args.num_prompts, args.max_new_tokens, *args.decoding_lengths) < 1:
        return "--num-prompts, --max-new-tokens and --decoding-lengths must be >= 1"
    return None


def _ceiling(args: argparse.Namespace, datasets: list[str]) -> int:
    from pathlib import Path

    from batchserve.bench import ceiling

    out = Path(args.out)
    rows = ceiling.main(datasets, args.decoding_lengths, args.num_prompts, args.max_new_tokens, args.model, out)
    print("\n".join(ceiling.report_lines(rows, args.max_new_tokens)))
    print(f"wrote {out / 'ceiling.md'}, {out / 'ceiling.json'}")
    return 0


def _shape_commands(args: argparse.Namespace) -> int:
    """`--write-gguf` (a file of the shape) or `--shape` (its cost curve on this device)."""
    if args.write_gguf is not None:
        from batchserve.bench.gguf_write import write_gguf_command

        return write_gguf_command(args)
    return shape_command(args)


def _as_served(methods: list[str], model: str | None) -> list[str]:
    """Plain method names on the weights `make serve` runs here (cpu_weights=auto's choice),
    the weights named in each (`none` -> `none-gguf`), and the choice printed with its reason."""
    import torch

    from batchserve.bench.host import served_weights
    from batchserve.bench.methods import as_served

    weights, why = served_weights(not torch.cuda.is_available(), model)
    served = as_served(methods, weights)
    if served != methods:
        print(f"batchserve bench: plain methods run make serve's {weights} weights here ({why}): "
              f"{', '.join(served)} (name -f32 for float32)")  # fmt: skip
    return served


def _checked(args: argparse.Namespace) -> tuple[str | None, list[str], list[str]]:
    """(what the bench refuses in these arguments, or None; the datasets; the methods as served),
    before anything loads. Fills in `args.batch_sizes`' default."""
    datasets = [d.strip() for d in args.dataset.split(",") if d.strip()]
    if args.curve is not None and not args.simulate:
        return "--curve goes with --simulate (it predicts from a measured curve)", datasets, []
    if args.batch_sizes is None and args.curve is None:
        args.batch_sizes = list(BENCH_BATCH_SIZES)
    problem = dataset_problem(datasets)
    if problem is None and args.simulate and set(datasets) - {"humaneval", "sharegpt"}:
        problem = "--simulate replays humaneval and sharegpt only"
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not args.simulate and not args.ceiling:
        methods = _as_served(methods, args.model)
    if problem is None and args.ceiling:
        problem = _ceiling_problem(args)
    elif problem is None and not args.simulate:
        problem = _bench_problem(args, methods)
    return problem, datasets, methods


def bench_problem(args: argparse.Namespace) -> str | None:
    """What `bench_command` would refuse in these parsed arguments (None: they run); the GPU check's
    dry run asks it of every bench step (scripts/gpu_dry_step.py)."""
    if args.write_gguf is not None or args.shape is not None:
        return None
    return _checked(args)[0]


def bench_command(args: argparse.Namespace) -> int:
    if args.write_gguf is not None or args.shape is not None:
        return _shape_commands(args)
    problem, datasets, methods = _checked(args)
    if problem is not None:
        print(f"batchserve bench: {problem}", file=sys.stderr)
        return 2
    if args.ceiling:
        return _ceiling(args, datasets)
    if args.simulate and args.curve is not None:
        return predict_command(args, datasets)
    if args.simulate:
        from batchserve.bench.simulate import main as simulate_main

        simulate_main(datasets, args.decoding_lengths, args.num_samples, args.model, speed=not args.no_speed)
        return 0
    from pathlib import Path

    from batchserve.bench import run, summary_table
    from batchserve.bench.compiled import StaticPeer

    out = Path(args.out)
    rows = run(
        datasets,
        methods,
        args.batch_sizes,
        args.num_prompts,
        args.max_new_tokens,
        out,
        args.model,
        args.decoding_length,
        args.dtype,
        args.repeats,
        args.keep,
        args.waves,
        args.request_rates,
        StaticPeer(args.peer_repeats, args.hf_static_max_ms),
    )
    print(summary_table(rows))
    print(f"wrote {out / 'results.json'}, {out / 'report.md'}, {out / 'throughput.png'}")
    if any(r.lossless is False for r in rows) and not args.allow_mismatch:
        print("batchserve bench: some outputs differ from HF greedy (lossless=false): a bug", file=sys.stderr)
        return 1
    return 0


def add_plot_parser(sub: Any) -> None:
    plot = sub.add_parser(
        "plot", help="draw throughput and speedup over none against requests in flight, from bench results"
    )
    plot.add_argument(
        "results",
        nargs="+",
        help="results.json files or bench --out directories; a later one's point replaces an earlier one's",
    )
    plot.add_argument("--out", default="concurrency.png", help="the PNG to write")
    plot.add_argument("--title", default=None, help="a line above the panels (say what the runs measured)")
    plot.add_argument("--methods", default=None, help="comma-separated methods to draw (default: every one)")


def plot_command(args: argparse.Namespace) -> int:
    from pathlib import Path

    from batchserve.bench.methods import read_rows
    from batchserve.bench.plots import plot_concurrency

    try:
        rows = read_rows([Path(p) for p in args.results])
        if args.methods is not None:
            wanted = {m.strip() for m in args.methods.split(",") if m.strip()}
            rows = [r for r in rows if r.method in wanted]
        plot_concurrency(rows, Path(args.out), args.title)
    except (ValueError, OSError) as e:
        print(f"batchserve plot: {e}", file=sys.stderr)
        return 2
    datasets = ", ".join(dict.fromkeys(r.dataset for r in rows))
    print(f"wrote {args.out}: {len(rows)} points of {datasets}")
    return 0

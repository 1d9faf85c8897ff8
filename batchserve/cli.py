"""The `batchserve` command line: serve, calibrate, generate, bench, tune, plot and perplexity."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from batchserve.bench.commands import (
    add_bench_parser,
    add_plot_parser,
    bench_command,
    dataset_problem,
    int_list,
    plot_command,
)
from batchserve.bench.perplexity import add_perplexity_parser, perplexity_command
from batchserve.config import SETTINGS, EngineConfig, Setting, settings_of

SECTION_TITLES = {
    "model": "model",
    "cache": "KV cache",
    "scheduler": "batching",
    "draft": "drafting",
    "limits": "per-request limits",
    "": "server",
}


def add_settings(parser: argparse.ArgumentParser, settings: list[Setting]) -> None:
    """One flag per setting (with its older spellings), grouped by section, defaults from the dataclasses."""
    groups: dict[str, Any] = {}
    for s in settings:
        if s.section not in groups:
            groups[s.section] = parser.add_argument_group(SECTION_TITLES.get(s.section, s.section))
        kwargs: dict[str, Any] = {"dest": s.name, "default": s.default, "help": s.help}
        if s.kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = s.kind
            kwargs["choices"] = s.choices
        if s.default is not None and s.kind is not bool:
            kwargs["help"] += f" (default: {s.default})"
        groups[s.section].add_argument(s.flag, *s.flags, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batchserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    _calibrate_parser(sub)
    _generate_parser(sub)
    add_bench_parser(sub)
    _tune_parser(sub)
    add_plot_parser(sub)
    add_perplexity_parser(sub)
    return parser


def _server_settings() -> list[Setting]:
    from batchserve.server.app import ServerConfig

    return settings_of(ServerConfig)


def _serve_parser(sub: Any) -> None:
    serve = sub.add_parser("serve", help="run the server: gRPC and the OpenAI HTTP API over one engine")
    add_settings(serve, _server_settings() + list(SETTINGS.values()))
    serve.add_argument("--log-level", default="INFO")


def _calibrate_parser(sub: Any) -> None:
    cal = sub.add_parser("calibrate", help="measure step time against tokens per step; save the cost profile")
    add_settings(cal, [s for s in SETTINGS.values() if s.section == "model" and s.name != "max_model_len"])
    cal.add_argument("--max-tokens", type=int, default=512, help="largest step to time (the server's tokens per step)")
    cal.add_argument("--contexts", type=int_list, default=[64, 512, 2048], help="KV lengths to time at")
    cal.add_argument("--repeats", type=int, default=9, help="timed runs per shape (lower quartile)")
    cal.add_argument("--out", default=None, help="profile path (default: the per-device cache the server reads)")


def _generate_parser(sub: Any) -> None:
    gen = sub.add_parser("generate", help="send one request to a running server")
    gen.add_argument("prompt")
    gen.add_argument(
        "--target",
        default="127.0.0.1:50051",
        help="host:port, or several replicas: dns:///host:port, ipv4:127.0.0.1:p1,127.0.0.1:p2",
    )
    gen.add_argument(
        "--load-balancing",
        default="round_robin",
        choices=("round_robin", "pick_first"),
        help="how calls spread over the target's replicas (UNAVAILABLE is retried on another)",
    )
    gen.add_argument("--stream", action="store_true", help="print text as it arrives")
    gen.add_argument(
        "--api-key", default=None, help="sent as `Authorization: Bearer KEY` (default: $BATCHSERVE_API_KEY)"
    )
    gen.add_argument("--max-new-tokens", type=int, default=None)
    gen.add_argument("--temperature", type=float, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="send the prompt as one user chat message")
    gen.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    gen.add_argument("--json", action="store_true", help="print one JSON object with the result")


def _tune_parser(sub: Any) -> None:
    tune = sub.add_parser(
        "tune",
        help="measure this machine on a workload and recommend max-num-seqs, the token budget and drafts for SLOs",
    )
    tune.add_argument("--dataset", default="humaneval", help="a bench dataset name or FILE.jsonl of your prompts")
    tune.add_argument("--slo-ttft-ms", type=float, default=None, help="time-to-first-token goal (ms)")
    tune.add_argument("--slo-tpot-ms", type=float, default=None, help="time-per-output-token goal (ms)")
    tune.add_argument("--percentile", type=float, default=99.0, help="the goals hold for this percentile of requests")
    tune.add_argument("--concurrency", type=int_list, default=[1, 2, 4, 8, 16], help="max-num-seqs values to try")
    tune.add_argument(
        "--token-budgets", type=int_list, default=[256, 1024], help="max-num-batched-tokens to try at the best point"
    )
    tune.add_argument("--num-prompts", type=int, default=16, help="prompts per run (at least)")
    tune.add_argument("--waves", type=int, default=2, help="each run sends max(num-prompts, waves x concurrency)")
    tune.add_argument("--max-new-tokens", type=int, default=128)
    tune.add_argument("--model", default=None, help="model (default: SmolLM2)")
    tune.add_argument("--confirm", action="store_true", help="run the recommendation again and report how it held")
    tune.add_argument("--repeats", type=int, default=1, help="runs per point; the median by tokens/s stands for it")
    tune.add_argument("--out", default="tune_out", help="directory for tune.md, tune.json, tune.png")


def engine_config(args: argparse.Namespace, settings: list[Setting] | None = None) -> EngineConfig:
    """The EngineConfig the parsed flags describe (every engine setting the parser has)."""
    chosen = settings if settings is not None else list(SETTINGS.values())
    return EngineConfig().with_settings(**{s.name: getattr(args, s.name) for s in chosen if hasattr(args, s.name)})


def _serve(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import time

    started = time.monotonic()
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from batchserve.server.settings import PortInUse, ServerConfig, check_ports

    try:
        config = engine_config(args)
        server_config = ServerConfig(**{s.field: getattr(args, s.name) for s in _server_settings()})
        from batchserve.threads import resolve_threads

        threads, source = resolve_threads(config.model.num_threads)
        config = config.with_settings(num_threads=threads)
        logging.getLogger("batchserve").info("torch threads: %d (%s)", threads, source)
    except ValueError as e:
        print(f"batchserve serve: {e}", file=sys.stderr)
        return 2
    try:
        check_ports(server_config)  # before the model loads: a clash is reported in a moment
    except PortInUse as e:
        print(f"batchserve serve: {e}", file=sys.stderr)
        return 1
    from batchserve.async_engine import AsyncEngine
    from batchserve.model.loader import resolve_model_path
    from batchserve.server.app import BatchServer, serve_forever

    try:
        engine = AsyncEngine.build(config)  # in the thread that runs its steps (AsyncEngine.build)
    except (FileNotFoundError, ValueError) as e:
        print(f"batchserve serve: {e}", file=sys.stderr)
        return 2
    core = engine.core
    directory, gguf = resolve_model_path(config.model.path)
    server = BatchServer(
        engine,
        server_config,
        model_name=str(directory / gguf if gguf else directory),
        dtype=str(next(core.runner.model.parameters()).dtype).removeprefix("torch."),
    )
    from batchserve import heap

    heap.settle()  # the model, tokenizer and libraries: never walked by a full collection again
    try:
        return asyncio.run(serve_forever(server, started))
    except PortInUse as e:  # taken between the check and the bind
        print(f"batchserve serve: {e}", file=sys.stderr)
        return 1


def _calibrate(args: argparse.Namespace) -> int:
    from batchserve.engine import EngineCore
    from batchserve.runner.calibrate import calibrate
    from batchserve.runner.profile_key import format_profile, profile_path

    try:
        if args.max_tokens < 1 or args.repeats < 1 or not args.contexts or min(args.contexts) < 0:
            raise ValueError("--max-tokens and --repeats must be >= 1 and --contexts non-negative")
        config = engine_config(args).with_settings(
            kv_cache_memory_gb=1.0, max_num_batched_tokens=max(16, args.max_tokens), draft="none"
        )
        core = EngineCore(config)
    except (FileNotFoundError, ValueError) as e:
        print(f"batchserve calibrate: {e}", file=sys.stderr)
        return 2
    profile = calibrate(
        core.runner,
        max_tokens=args.max_tokens,
        max_context=core.facts.max_model_len,
        contexts=tuple(sorted(set(args.contexts))),
        repeats=args.repeats,
    )
    out = args.out or profile_path(profile.key)
    profile.save(out)
    print(format_profile(profile))
    print(f"\nsaved to {out}")
    return 0


def _tune(args: argparse.Namespace) -> int:
    def fail(message: str) -> int:
        print(f"batchserve tune: {message}", file=sys.stderr)
        return 2

    problem = dataset_problem([args.dataset])
    if problem is not None:
        return fail(problem)
    counts = (args.num_prompts, args.max_new_tokens, args.repeats, *args.concurrency, *args.token_budgets)
    if not args.concurrency or min(counts) < 1 or args.waves < 0:
        return fail(
            "--concurrency, --token-budgets, --num-prompts, --max-new-tokens and --repeats must be >= 1, --waves >= 0"
        )
    from pathlib import Path

    from batchserve.tune import Goals, answer_lines, tune

    try:
        goals = Goals(args.slo_ttft_ms, args.slo_tpot_ms, args.percentile)
    except ValueError as e:
        return fail(str(e))
    out = Path(args.out)
    result = tune(
        args.dataset,
        goals,
        args.concurrency,
        args.token_budgets,
        args.num_prompts,
        args.waves,
        args.max_new_tokens,
        args.model,
        out,
        args.confirm,
        args.repeats,
    )
    print("\n".join(answer_lines(result)))
    print(f"wrote {out / 'tune.md'}, {out / 'tune.json'}, {out / 'tune.png'}")
    return 0 if result.best is not None else 1


def _generate(args: argparse.Namespace) -> int:
    # gRPC stays inside batchserve/server/.
    from batchserve.server.client_cli import generate_command

    return generate_command(args)


COMMANDS = {
    "serve": _serve,
    "calibrate": _calibrate,
    "generate": _generate,
    "bench": bench_command,
    "tune": _tune,
    "plot": plot_command,
    "perplexity": perplexity_command,
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return COMMANDS[args.command](args)


if __name__ == "__main__":
    sys.exit(main())

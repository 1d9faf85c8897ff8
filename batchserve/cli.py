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

    serve = sub.add_parser("serve", help="run the gRPC server")
    serve.add_argument("--model", default=None, help="HF model directory or .gguf file (default: SmolLM2)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=50051)
    serve.add_argument("--metrics-port", type=int, default=None, help="Prometheus endpoint port (off if unset)")
    serve.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "float16", "bfloat16"],
        help="auto: bf16 on GPU, fp32 on CPU",
    )
    serve.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (auto: cuda when available)")
    serve.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "flashinfer", "torch"],
        help="auto: FlashInfer on CUDA in fp16/bf16 when installed, else the PyTorch reference",
    )
    serve.add_argument(
        "--cpu-linear",
        default="torch",
        choices=["torch", "onednn"],
        help="float32 on CPU: torch's matmuls, or oneDNN's linear kernel (faster drafts; memory grows with shapes)",
    )
    serve.add_argument("--max-batch-size", type=int, default=16, help="running requests at once")
    serve.add_argument("--max-tokens-per-step", type=int, default=512, help="tokens per forward")
    serve.add_argument("--kv-cache-gb", type=float, default=1.0, help="KV cache size")
    serve.add_argument("--block-size", type=int, default=16, help="KV slots per block")
    serve.add_argument("--draft", default="lookahead", choices=["none", "llma", "lookahead"])
    serve.add_argument(
        "--draft-policy",
        default="adaptive",
        choices=["adaptive", "fixed"],
        help="adaptive: per-request draft lengths from the cost profile and acceptance; fixed: --decoding-length",
    )
    serve.add_argument(
        "--decoding-length",
        type=int,
        default=None,
        help="draft tokens per request per step (fixed; default 16) or the per-request cap (adaptive; default 64)",
    )
    serve.add_argument("--profile", default=None, help="cost profile JSON (default: the per-device cache)")
    serve.add_argument("--draft-layout", default="hierarchical", choices=["hierarchical", "parallel", "single"])
    serve.add_argument("--warmup", default=None, help="JSONL of earlier outputs to warm the trie with")
    serve.add_argument("--warmup-scope", default="", help="the tenant key the warm-up corpus serves (default: '')")
    serve.add_argument(
        "--trie-scope",
        default="tenant",
        choices=["global", "tenant", "request"],
        help="who shares output n-grams: every request, requests with the same tenant key (default; "
        "requests without one share ''), or nobody",
    )
    serve.add_argument("--max-waiting", type=int, default=256, help="waiting requests before RESOURCE_EXHAUSTED")
    serve.add_argument("--grace", type=float, default=30.0, help="seconds in-flight requests get at shutdown")
    serve.add_argument(
        "--drain-seconds",
        type=float,
        default=0.0,
        help="at shutdown, report NOT_SERVING this long (still serving) before refusing new calls",
    )
    serve.add_argument("--no-reflection", action="store_true", help="turn gRPC server reflection off")
    serve.add_argument("--tls-cert", default=None, help="PEM certificate chain: serve TLS")
    serve.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    serve.add_argument("--tls-client-ca", default=None, help="PEM CA bundle: require client certificates (mTLS)")
    serve.add_argument(
        "--max-message-bytes",
        type=int,
        default=None,
        help="largest gRPC message (default: what a full context needs, about 1 MiB for SmolLM2)",
    )
    serve.add_argument("--max-stop-sequences", type=int, default=16, help="stop strings per request")
    serve.add_argument("--max-stop-length", type=int, default=256, help="characters per stop string")
    serve.add_argument("--log-level", default="INFO")

    cal = sub.add_parser("calibrate", help="measure step time against tokens per step; save the cost profile")
    cal.add_argument("--model", default=None, help="HF model directory or .gguf file (default: SmolLM2)")
    cal.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    cal.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (auto: cuda when available)")
    cal.add_argument("--attention-backend", default="auto", choices=["auto", "flashinfer", "torch"])
    cal.add_argument(
        "--cpu-linear",
        default="torch",
        choices=["torch", "onednn"],
        help="float32 on CPU: torch's matmuls, or oneDNN's linear kernel (faster drafts; memory grows with shapes)",
    )
    cal.add_argument("--max-tokens", type=int, default=512, help="largest step to time (the server's tokens per step)")
    cal.add_argument("--contexts", type=_ints, default=[64, 512, 2048], help="KV lengths to time at")
    cal.add_argument("--repeats", type=int, default=9, help="timed runs per shape (lower quartile)")
    cal.add_argument("--out", default=None, help="profile path (default: the per-device cache the server reads)")

    gen = sub.add_parser("generate", help="send one request to a running server")
    gen.add_argument("prompt")
    gen.add_argument("--target", default="127.0.0.1:50051")
    gen.add_argument("--stream", action="store_true", help="print text as it arrives")
    gen.add_argument("--max-new-tokens", type=int, default=None)
    gen.add_argument("--temperature", type=float, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="send the prompt as one user chat message")
    gen.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    gen.add_argument("--json", action="store_true", help="print one JSON object with the result")

    bench = sub.add_parser("bench", help="benchmarks against peers (or --simulate: drafts without the model)")
    bench.add_argument("--dataset", default="humaneval,sharegpt", help="humaneval, sharegpt or both (comma-separated)")
    bench.add_argument("--model", default=None, help="model (default: SmolLM2)")
    bench.add_argument("--num-prompts", type=int, default=16, help="test prompts per dataset (at least)")
    bench.add_argument(
        "--waves",
        type=int,
        default=0,
        help="batch b runs at least waves*b prompts, so the closed loop stays full (0: --num-prompts for all)",
    )
    bench.add_argument("--batch-sizes", type=_ints, default=[1, 2, 4, 8, 16], help="requests in flight")
    bench.add_argument(
        "--methods",
        default="hf,hf-prompt-lookup,hf-batch,none,llma,parallel,lookahead",
        help="comma-separated: hf, hf-static (static cache + compiled forward), hf-prompt-lookup, hf-batch, none, "
        "llma, parallel, lookahead, lookahead-cold, lookahead-4|16|64, lookahead-adaptive",
    )
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--decoding-length", type=int, default=16)
    bench.add_argument("--repeats", type=int, default=1, help="runs per batchserve method and batch, in rounds")
    bench.add_argument(
        "--keep", default="fastest", choices=["fastest", "median"], help="which of the repeated runs is reported"
    )
    bench.add_argument("--dtype", default="float32", choices=["auto", "float32", "float16", "bfloat16"])
    bench.add_argument(
        "--allow-mismatch", action="store_true", help="fp16/bf16: report outputs that differ from HF, do not fail"
    )
    bench.add_argument("--out", default="bench_out", help="directory for results.json, report.md, throughput.png")
    bench.add_argument("--simulate", action="store_true", help="drafters' step compression, no model run")
    bench.add_argument("--decoding-lengths", type=_ints, default=[4, 8, 16, 32, 64], help="--simulate only")
    bench.add_argument("--num-samples", type=int, default=164, help="--simulate: samples per dataset (half dev)")
    bench.add_argument("--no-speed", action="store_true", help="--simulate: skip the trie timing and memory")
    return parser


def _serve(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import time

    started = time.monotonic()

    from batchserve.config import CacheConfig, DraftConfig, EngineConfig, LimitsConfig, ModelConfig, SchedulerConfig

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = EngineConfig(
            model=ModelConfig(
                path=args.model,
                dtype=args.dtype,
                device=args.device,
                attention_backend=args.attention_backend,
                cpu_linear=args.cpu_linear,
            ),
            cache=CacheConfig(block_size=args.block_size, kv_cache_memory_gb=args.kv_cache_gb),
            scheduler=SchedulerConfig(
                max_num_seqs=args.max_batch_size, max_num_batched_tokens=args.max_tokens_per_step
            ),
            draft=DraftConfig(
                method=args.draft,
                decoding_length=args.decoding_length
                if args.decoding_length is not None
                else (64 if args.draft_policy == "adaptive" else 16),
                layout=args.draft_layout,
                warmup_path=args.warmup,
                warmup_scope=args.warmup_scope,
                trie_scope=args.trie_scope,
                adaptive=args.draft_policy == "adaptive",
                profile_path=args.profile,
            ),
            limits=LimitsConfig(max_stop_sequences=args.max_stop_sequences, max_stop_length=args.max_stop_length),
        )
        from batchserve.server.app import ServerConfig

        server_config = ServerConfig(
            host=args.host,
            port=args.port,
            metrics_port=args.metrics_port,
            max_waiting_requests=args.max_waiting,
            grace_seconds=args.grace,
            drain_seconds=args.drain_seconds,
            max_message_bytes=args.max_message_bytes,
            reflection=not args.no_reflection,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            tls_client_ca=args.tls_client_ca,
        )
    except ValueError as e:
        print(f"batchserve serve: {e}", file=sys.stderr)
        return 2
    from batchserve.engine import AsyncEngine, EngineCore
    from batchserve.runner.model_loader import resolve_model_path
    from batchserve.server.app import BatchServer, serve_forever

    try:
        core = EngineCore(config)
    except (FileNotFoundError, ValueError) as e:
        print(f"batchserve serve: {e}", file=sys.stderr)
        return 2
    directory, gguf = resolve_model_path(args.model)
    server = BatchServer(
        AsyncEngine(core),
        server_config,
        model_name=str(directory / gguf if gguf else directory),
        dtype=str(next(core.runner.model.parameters()).dtype).removeprefix("torch."),
    )
    return asyncio.run(serve_forever(server, started))


def _calibrate(args: argparse.Namespace) -> int:
    from batchserve.config import CacheConfig, DraftConfig, EngineConfig, ModelConfig, SchedulerConfig
    from batchserve.engine import EngineCore
    from batchserve.runner.calibrate import calibrate, format_profile, profile_path

    try:
        if args.max_tokens < 1 or args.repeats < 1 or not args.contexts or min(args.contexts) < 0:
            raise ValueError("--max-tokens and --repeats must be >= 1 and --contexts non-negative")
        config = EngineConfig(
            model=ModelConfig(
                path=args.model,
                dtype=args.dtype,
                device=args.device,
                attention_backend=args.attention_backend,
                cpu_linear=args.cpu_linear,
            ),
            cache=CacheConfig(kv_cache_memory_gb=1.0),
            scheduler=SchedulerConfig(max_num_batched_tokens=max(16, args.max_tokens)),
            draft=DraftConfig(method="none"),
        )
        core = EngineCore(config)
    except (FileNotFoundError, ValueError) as e:
        print(f"batchserve calibrate: {e}", file=sys.stderr)
        return 2
    profile = calibrate(
        core.runner,
        max_tokens=args.max_tokens,
        max_context=core.max_model_len,
        contexts=tuple(sorted(set(args.contexts))),
        repeats=args.repeats,
    )
    out = args.out or profile_path(profile.key)
    profile.save(out)
    print(format_profile(profile))
    print(f"\nsaved to {out}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    # gRPC stays inside batchserve/server/.
    from batchserve.server.client import generate_command

    return generate_command(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "generate":
        return _generate(args)
    if args.command == "calibrate":
        return _calibrate(args)
    if args.command == "bench":
        return _bench(args)
    return 0


def _bench(args: argparse.Namespace) -> int:
    datasets = [d.strip() for d in args.dataset.split(",") if d.strip()]
    unknown = set(datasets) - {"humaneval", "sharegpt"}
    if unknown or not datasets:
        print(f"batchserve bench: unknown dataset(s) {sorted(unknown)}", file=sys.stderr)
        return 2
    if args.simulate:
        from benchmarks.simulate import main as simulate_main

        simulate_main(datasets, args.decoding_lengths, args.num_samples, args.model, speed=not args.no_speed)
        return 0
    from pathlib import Path

    from benchmarks.bench import METHODS, run, summary_table

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        print(f"batchserve bench: unknown method(s) {bad}; choose from {', '.join(METHODS)}", file=sys.stderr)
        return 2
    if (
        args.num_prompts < 1
        or args.max_new_tokens < 1
        or args.repeats < 1
        or args.waves < 0
        or not args.batch_sizes
        or min(args.batch_sizes) < 1
    ):
        print(
            "batchserve bench: --num-prompts, --max-new-tokens, --repeats and --batch-sizes must be >= 1, --waves >= 0",
            file=sys.stderr,
        )
        return 2
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
    )
    print(summary_table(rows))
    print(f"wrote {out / 'results.json'}, {out / 'report.md'}, {out / 'throughput.png'}")
    if any(r.lossless is False for r in rows) and not args.allow_mismatch:
        print("batchserve bench: some outputs differ from HF greedy (lossless=false): a bug", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

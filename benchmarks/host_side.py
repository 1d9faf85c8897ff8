"""The host side of an engine step (schedule + prepare + verify + commit), without a forward.

    python benchmarks/host_side.py [--num-prompts 32] [--max-new-tokens 128] [--points 1:16,16:8]
    python benchmarks/host_side.py --emulate [--points 1:0,1:16,1:adaptive,16:0,16:8,16:adaptive]

The engine runs the default model's tokenizer on HumanEval prompts with a stand-in forward that
costs nothing (`batchserve.bench.host`, timed by `batchserve.bench.host_timing`): what a step
costs here is what the host adds to every GPU step. Each point is requests in flight : draft
tokens per request (fixed, trie drafts). Medians over the steps with every seat taken and no
prompt chunk.

With --emulate the forward takes an H100's time (SmolLM2 bf16 replayed from graphs: its start-up
profile, `batchserve.bench.host.H100_SMOLLM2`) on an emulated asynchronous device, and each point
runs with the sequential loop and with the pipelined one (outputs built beside the next forward):
the host's critical path per step, and tokens/s. A decoding length of 0 is `none`; `adaptive`
is the adaptive policy, planning with the emulated device's profile.
"""

from __future__ import annotations

import argparse

from batchserve.bench.datasets import humaneval
from batchserve.bench.host import emulated_engine
from batchserve.bench.host_timing import HOST_PHASES, measure_emulated, time_host
from batchserve.model.loader import load_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--points", default="1:16,16:8", help="requests:decoding_length, comma-separated")
    parser.add_argument("--emulate", action="store_true", help="an emulated H100 forward; sequential vs pipelined")
    args = parser.parse_args()
    tokenizer = load_tokenizer()
    prompts = [tokenizer.encode(s.prompt) for s in humaneval()[: args.num_prompts]]
    if args.emulate:
        emulate(prompts, tokenizer, args.points, args.max_new_tokens)
        return
    points = [tuple(int(x) for x in p.split(":")) for p in args.points.split(",")]
    stats = time_host(prompts, tokenizer, len(tokenizer), points, args.max_new_tokens)
    print("| requests | draft tokens | steps | rows/step | tokens/step | " + " | ".join(HOST_PHASES) + " | host ms |")
    print("|---" * (6 + len(HOST_PHASES)) + "|")
    for (requests, length), s in zip(points, stats):
        cells = " | ".join(f"{s.phase_ms[n]:.2f}" for n in HOST_PHASES)
        head = f"| {requests} | {length} | {s.steps} | {s.rows:.1f} | {s.tokens_per_step:.2f}"
        print(f"{head} | {cells} | **{s.host_ms:.2f}** |")


def emulate(prompts: list[list[int]], tokenizer: object, points: str, max_new_tokens: int) -> None:
    print("| requests | drafts | loop | steps | critical host ms | outputs ms | device ms | tokens/step | tokens/s |")
    print("|---" * 9 + "|")
    for point in points.split(","):
        requests, length = point.split(":")
        adaptive = length == "adaptive"
        for pipelined in (False, True):
            core = emulated_engine(prompts, tokenizer, len(tokenizer), int(requests), 64 if adaptive else int(length),
                                   adaptive=adaptive)  # fmt: skip
            s = measure_emulated(core, prompts, int(requests), max_new_tokens, pipelined)
            loop = "pipelined" if pipelined else "sequential"
            print(
                f"| {requests} | {length} | {loop} | {s.steps} | **{s.critical_ms:.2f}** | {s.outputs_ms:.2f} | "
                f"{s.device_ms:.2f} | {s.tokens_per_step:.2f} | {s.tokens_per_s:.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()

"""`batchserve bench --simulate`: step compression of each drafter without running the model.

For HumanEval (prompt -> canonical solution) and ShareGPT (first human turn, rendered with
the chat template -> first reply), the trie is warmed on the dev split's outputs and every
test sample is replayed with LLMA's target-guided simulation. Also measures the trie's
retrieval + update time per step on a warmed trie of 100k+ nodes, and its memory. With a cost
curve (`--curve`), the same replay predicts tokens/s instead (`predict.py`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from batchserve.bench.datasets import Sample, humaneval, sharegpt, split
from batchserve.config import DraftConfig
from batchserve.draft import Drafter, SingleBranchDrafter, TrieDrafter
from batchserve.draft.simulate import SimulationResult, simulate

LAYOUTS = ("single", "parallel", "hierarchical")


@dataclass(slots=True)
class Encoded:
    prompt: list[int]
    output: list[int]
    prediction: list[int] = field(default_factory=list)  # a predicted output sent with the request, if any


def encode(samples: list[Sample], tokenizer: Any) -> list[Encoded]:
    out = []
    for s in samples:
        if s.chat:
            text = tokenizer.apply_chat_template(s.messages(), tokenize=False, add_generation_prompt=True)
        else:
            text = s.prompt
        out.append(
            Encoded(
                tokenizer(text, add_special_tokens=False).input_ids,
                tokenizer(s.reference, add_special_tokens=False).input_ids,
            )
        )
    return out


def replay(make: Callable[[], Drafter], warm: list[list[int]], test: list[Encoded], length: int) -> SimulationResult:
    drafter = make()
    if isinstance(drafter, TrieDrafter):
        drafter.warm_up(warm)
    total = SimulationResult()
    for i, s in enumerate(test):
        references = [s.prediction] if s.prediction else []
        total.merge(simulate(drafter, f"sim-{i}", s.prompt, s.output, length, references))
    return total


def encoded_split(name: str, num_samples: int, tokenizer: Any) -> tuple[list[list[int]], list[Encoded]]:
    """(the dev outputs that warm the trie, the test samples) of `name`'s first `num_samples`."""
    samples = humaneval() if name == "humaneval" else sharegpt(num_samples)
    dev, test = split(samples[:num_samples])
    return [e.output for e in encode(dev, tokenizer)], encode(test, tokenizer)


def run(datasets: list[str], lengths: list[int], num_samples: int, tokenizer: Any) -> str:
    lines = []
    for name in datasets:
        warm, test_e = encoded_split(name, num_samples, tokenizer)
        lines.append(f"\n### {name}: {len(test_e)} test samples, trie warmed on {len(warm)} dev outputs\n")
        lines.append("| drafter | " + " | ".join(f"L={n}" for n in lengths) + " |")
        lines.append("|---|" + "---|" * len(lengths))
        makers: dict[str, Callable[[], Drafter]] = {"llma (suffix copy)": SingleBranchDrafter}
        for layout in LAYOUTS:
            makers[f"trie {layout}"] = lambda layout=layout: TrieDrafter(DraftConfig(layout=layout))
        makers["trie hierarchical, cold"] = lambda: TrieDrafter(DraftConfig())
        for label, make in tqdm(makers.items(), desc=f"simulate {name}"):
            cold = label.endswith("cold")
            cells = [f"{replay(make, [] if cold else warm, test_e, n).tokens_per_step:.2f}" for n in lengths]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def trie_speed(tokenizer: Any, length: int = 64, min_nodes: int = 100_000) -> str:
    """Median retrieval + update time per request-step on a warmed trie of `min_nodes`+ nodes."""
    samples = sharegpt(6000)
    dev, test = split(samples)
    config = DraftConfig(decoding_length=length, trie_capacity=400_000)
    drafter = TrieDrafter(config)
    warm_texts = [s.reference for s in dev]
    for text in tqdm(warm_texts, desc="warm trie"):
        drafter.warm_up([tokenizer(text, add_special_tokens=False).input_ids])
        if drafter.num_nodes >= min_nodes * 1.5:
            break
    nodes = drafter.num_nodes
    times: list[float] = []
    for i, s in enumerate(tqdm(encode(test[:40], tokenizer), desc="timed replay")):
        times.extend(simulate(drafter, f"t-{i}", s.prompt, s.output[:256], length).step_seconds)
    median_ms = statistics.median(times) * 1e3
    p90_ms = statistics.quantiles(times, n=10)[-1] * 1e3

    # Memory of a trie filled to its default capacity (native: counted by the drafter itself).
    full = TrieDrafter(DraftConfig())
    for s in dev:
        full.warm_up([tokenizer(s.reference, add_special_tokens=False).input_ids])
        if full.num_nodes >= full.config.trie_capacity * 0.95:
            break
    size = full.memory_bytes()
    return (
        f"\nretrieval + update per request-step (decoding length {length}, warmed trie of {nodes:,} nodes): "
        f"median {median_ms:.3f} ms, p90 {p90_ms:.3f} ms over {len(times)} steps\n"
        f"trie memory: {size / 2**20:.1f} MB at {full.num_nodes:,} nodes "
        f"(capacity {full.config.trie_capacity:,}; {size / max(1, full.num_nodes):.0f} bytes/node)"
    )


def main(datasets: list[str], lengths: list[int], num_samples: int, model: str | None, speed: bool = True) -> None:
    from batchserve.runner import load_tokenizer

    tokenizer = load_tokenizer(model)
    t0 = time.perf_counter()
    print("## Mean tokens per step (target-guided simulation)")
    print(run(datasets, lengths, num_samples, tokenizer))
    if speed:
        print(trie_speed(tokenizer))
    print(f"\n({time.perf_counter() - t0:.0f} s)")

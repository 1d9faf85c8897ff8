"""How many tokens a step the trie drafter reaches on SmolLM2's own greedy outputs, with and
without its copy chain, and what copying could reach at best (target-guided replays).

Run from the repository root after `make setup` (a few minutes on 2 cores):
    .venv/bin/python scripts/replay_drafts.py [DATASETS] [NUM_PROMPTS] [NEW_TOKENS]
    (defaults: code-edit,doc-qa,summarize,humaneval,sharegpt 32 128)

1. Decodes each dataset's first NUM_PROMPTS test prompts plainly (bfloat16, greedy).
2. Replays those outputs through the trie drafter (warmed on the dev split, as the bench does)
   at decoding lengths 1, 2, 4 and 16, copy chain off and on: tokens a step.
3. Two bounds at length 16: the longest continuation found anywhere in the prompt and the
   output so far (an oracle that knows the output), and the same restricted to occurrences
   whose preceding token matches the text's last (where a drafter could find them).
"""

from __future__ import annotations

import sys

import numpy as np

from batchserve import LLM, SamplingParams
from batchserve.bench.runs import load_dataset
from batchserve.config import DraftConfig
from batchserve.draft import TrieDrafter
from batchserve.draft.simulate import simulate

LENGTHS = (1, 2, 4, 16)


def replay(warm: list[list[int]], prompts: list[list[int]], outputs: list[list[int]], length: int, copy: bool) -> float:
    drafter = TrieDrafter(DraftConfig(method="lookahead", copy_chain=copy))
    drafter.warm_up(warm)
    tokens = steps = 0
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        result = simulate(drafter, f"r{i}", prompt, output, length)
        tokens, steps = tokens + result.tokens, steps + result.steps
    return tokens / steps


def copy_bound(prompts: list[list[int]], outputs: list[list[int]], length: int, context: int) -> float:
    """Tokens a step when each step copies the longest continuation (at most `length`) that
    occurs in the text so far after `context` tokens equal to the text's last ones."""
    tokens = steps = 0
    for prompt, output in zip(prompts, outputs):
        text, done = list(prompt), 0
        while done < len(output):
            arr, best = np.array(text), 0
            for k in range(min(length, len(output) - done - 1), 0, -1):
                target = output[done : done + k]
                starts = np.flatnonzero(arr[: len(arr) - k + 1] == target[0])
                for j in range(1, k):
                    starts = starts[arr[starts + j] == target[j]]
                for a in range(context):  # the tokens before the copy agree with the text's end
                    starts = starts[starts - 1 - a >= 0]
                    starts = starts[arr[starts - 1 - a] == arr[-1 - a]]
                if len(starts):
                    best = k
                    break
            text += output[done : done + best + 1]  # the copy, then the model's own token
            done, steps, tokens = done + best + 1, steps + 1, tokens + best + 1
    return tokens / steps


def main() -> None:
    datasets = (sys.argv[1] if len(sys.argv) > 1 else "code-edit,doc-qa,summarize,humaneval,sharegpt").split(",")
    num_prompts = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    new_tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 128
    llm = LLM(cpu_weights="bfloat16", draft="none", max_num_seqs=8)
    print(f"tokens a step at decoding lengths {LENGTHS}, copy chain off | on; bounds at 16")
    for name in datasets:
        work = load_dataset(name, num_prompts, llm.tokenizer)
        results = llm.generate(work.prompts, SamplingParams(max_new_tokens=new_tokens), use_tqdm=False)
        outputs = [list(r.token_ids) for r in results]
        off, on = ([replay(work.warm, work.prompts, outputs, n, copy) for n in LENGTHS] for copy in (False, True))
        bounds = [copy_bound(work.prompts, outputs, 16, c) for c in (0, 1, 2)]
        print(
            f"{name}: {' / '.join(f'{x:.3f}' for x in off)} | {' / '.join(f'{x:.3f}' for x in on)}; "
            f"oracle {bounds[0]:.2f}, after a matching token {bounds[1]:.2f}, after two {bounds[2]:.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()

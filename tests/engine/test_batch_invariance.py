"""The batch-invariance contract on SmolLM2: a request's logits, bit for bit, do not depend on its company."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from batchserve import LLM, SamplingParams
from batchserve.config import CacheConfig, DraftConfig, EngineConfig, ModelConfig, SchedulerConfig
from batchserve.records import SchedulerOutput
from tests.prompts import all_prompt_ids

pytestmark = pytest.mark.slow
MAX_NEW = 16
TokenPath = tuple[int, ...]  # the tokens a row continues: the request's committed tokens, then its branch


class LogitsRecorder:
    """Hashes every kept row's logits under the token path it continues (rows whose path is known:
    a request's last committed token and its draft nodes; window rows are guesses and skipped).
    The same path seen twice (a preempted request recomputing its prompt) must hash the same."""

    def __init__(self, llm: LLM) -> None:
        self.rows: dict[TokenPath, str] = {}
        self.conflicts: list[TokenPath] = []
        engine = llm.engine
        runner, model = engine.runner, engine.runner.model
        execute, forward = runner.launch, model.forward
        pending: list[TokenPath | None] = []

        def record_forward(*args: Any, **kwargs: Any) -> Any:
            out = forward(*args, **kwargs)
            for path, row in zip(pending, out.logits[0]):
                if path is not None:
                    self._add(path, hashlib.blake2b(row.contiguous().numpy().tobytes(), digest_size=16).hexdigest())
            return out

        def record_execute(out: SchedulerOutput) -> Any:
            pending[:] = [p for r in out.requests if r.sample for p in self._paths(engine, r)]
            return execute(out)

        runner.launch = record_execute
        model.forward = record_forward

    @staticmethod
    def _paths(engine: Any, r: Any) -> list[TokenPath | None]:
        known = engine.scheduler.requests[r.request_id].all_token_ids
        committed = tuple(known[: r.num_computed_tokens + len(r.token_ids)])
        paths: list[TokenPath | None] = [committed]
        if r.draft is not None:
            branch: list[TokenPath] = []
            for token, parent in zip(r.draft.tokens, r.draft.parents):
                branch.append((committed if parent is None else branch[parent]) + (token,))
            paths += branch
        if r.window is not None:
            paths += [None] * r.window.num_outputs
        return paths

    def _add(self, path: TokenPath, digest: str) -> None:
        if self.rows.setdefault(path, digest) != digest:
            self.conflicts.append(path)


def _llm(model: Any, tokenizer: Any, draft: str, **kwargs: Any) -> LLM:
    """An engine over `model` (loaded, or a file path the engine reads itself) with these settings."""
    model_kwargs = {k: kwargs.pop(k) for k in ("attention_backend", "cpu_linear", "cpu_weights") if k in kwargs}
    if isinstance(model, Path):
        model_kwargs["path"] = str(model)
    cache = {k: kwargs.pop(k) for k in ("num_blocks", "prefix_caching") if k in kwargs}
    config = EngineConfig(
        model=ModelConfig(**model_kwargs),
        cache=CacheConfig(block_size=16, kv_cache_memory_gb=0.25, **cache),
        scheduler=SchedulerConfig(max_num_seqs=16, **kwargs),
        draft=DraftConfig(method=draft, adaptive=False, decoding_length=12),  # type: ignore[arg-type]
    )
    if isinstance(model, Path):
        return LLM(config=config)
    return LLM(config=config, hf_model=model, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def engine_model():
    from batchserve.runner import load_model

    return load_model(None, "float32")


@pytest.fixture(scope="module")
def prompts(engine_model) -> list[list[int]]:
    ids = all_prompt_ids(engine_model[1])
    # Short and long ones, four of them behind a shared prefix the batch serves from its cache.
    return ids[:4] + ids[6:8] + [ids[0][:40] + p for p in ids[8:12]]


def _compare(model: Any, tokenizer: Any, prompts: list[list[int]], **kernels: Any) -> tuple[int, int, list[str]]:
    """(rows compared, tokens generated, what differed) between each prompt run alone without drafts and all of them
    at once with drafts, small prompt chunks, the prefix cache and preemption (16 blocks)."""
    alone_llm = _llm(model, tokenizer, "none", **kernels)
    alone = LogitsRecorder(alone_llm)
    alone_out = [alone_llm.generate([p], SamplingParams(max_new_tokens=MAX_NEW))[0] for p in prompts]
    batch_llm = _llm(model, tokenizer, "lookahead", max_num_batched_tokens=64, num_blocks=40, **kernels)
    batch = LogitsRecorder(batch_llm)
    batch_out = batch_llm.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW))
    problems = [f"{len(r.conflicts)} paths hashed twice differently" for r in (alone, batch) if r.conflicts]
    pairs = enumerate(zip(alone_out, batch_out))
    problems += [f"prompt {i}: tokens differ" for i, (a, b) in pairs if a.token_ids != b.token_ids]
    differ = [p for p, digest in alone.rows.items() if batch.rows.get(p, digest) != digest]
    problems += [f"{len(differ)} of {len(alone.rows)} rows' logits differ"] if differ else []
    missing = [p for p in alone.rows if p not in batch.rows]
    problems += [f"{len(missing)} rows never computed in the batch"] if missing else []
    stats = [r.stats for r in batch_out]
    assert sum(s.draft_tokens_accepted for s in stats) > 0 and sum(s.num_preemptions for s in stats) > 0
    assert sum(s.cached_prompt_tokens for s in stats) > 0
    return len(alone.rows), sum(len(r.token_ids) for r in alone_out), problems


@pytest.mark.parametrize(
    ("weights", "attention"), [("float32", "kernel"), ("bfloat16", "kernel"), ("gguf", "invariant")]
)
def test_logits_are_bitwise_the_same_alone_and_in_any_batch(engine_model, prompts, weights, attention):
    """The native model on each of its CPU weights: float32 (PackedLinear products), bfloat16
    copies (on our kernel, KernelBf16Linear, else oneDNN's Bf16Linear), and the file read again
    from its blocks (BlockLinear) from the transformers model handed in, as the bench runs it;
    with our attention kernel, and with the torch-op invariant attention (the blocks on our
    kernel attention: test_every_block_type_is_bitwise_the_same_alone_and_in_any_batch)."""
    from batchserve import kernels

    if attention == "kernel" and not kernels.available():
        pytest.skip(f"our kernels cannot run here: {kernels.unavailable_reason()}")
    from batchserve.model import our_blocks_here
    from batchserve.model.bf16 import our_bf16_here
    from batchserve.model.blocks import BlockLinear
    from batchserve.model.layers import bf16_prepack_available

    if weights == "gguf" and not our_blocks_here():
        pytest.skip("our block kernels cannot run here")
    if weights == "bfloat16" and not (our_bf16_here() or bf16_prepack_available()):
        pytest.skip("neither our bfloat16 kernel nor oneDNN's runs on this CPU")
    llm = _llm(*engine_model, "none", cpu_weights=weights, attention_backend=attention)
    layers = {type(m) for m in llm.engine.runner.model.modules()}
    assert (BlockLinear in layers) == (weights == "gguf")
    if attention == "kernel":  # invariant by construction: its start-up check must pass, no fallback
        assert llm.engine.facts.attention_backend == "kernel"
    ours = weights == "gguf" or (weights == "bfloat16" and our_bf16_here())
    if ours and attention == "kernel":  # ours throughout: invariant by construction, on every CPU
        assert llm.engine.facts.batch_invariant, llm.engine.facts.invariance_why
    if not llm.engine.facts.batch_invariant:  # a third-party kernel: asserted through the start-up check only
        assert llm.engine.facts.invariance_why, "a server that is not invariant says why"
        pytest.skip(
            f"not batch-invariant on this CPU, and the start-up check says so: {llm.engine.facts.invariance_why}"
        )
    rows, tokens, problems = _compare(*engine_model, prompts, cpu_weights=weights, attention_backend=attention)
    assert rows == tokens and not problems, problems  # every token's row, alone and in the batch


def test_the_check_catches_kernels_that_are_not_batch_invariant(engine_model, prompts):
    """torch's float32 linear and SDPA: identical tokens (argmax rarely flips), different bits."""
    rows, tokens, problems = _compare(*engine_model, prompts, attention_backend="torch", cpu_linear="torch")
    assert rows == tokens and any("logits differ" in p for p in problems), problems


# SmolLM2's own weights in llama.cpp's mixes (bench/gguf_requant.py), read straight from their
# blocks: with the default Q4_1 file, every block type our kernels run, on real text (drafts accepted).
MIXES = {
    "Q4_K_M": {"Q4_K", "Q6_K", "Q5_0", "Q8_0"},  # 576-wide rows fall back from Q4_K to Q5_0
    "Q5_K_M": {"Q5_K", "Q6_K", "Q5_1", "Q8_0"},
    "IQ4_XS": {"IQ4_XS", "IQ4_NL", "Q5_K", "Q8_0"},  # 576-wide rows fall back to IQ4_NL, as llama-quantize's
    "Q2_K": {"Q2_K", "Q3_K", "Q4_0", "Q8_0"},  # with TENSOR_TYPES' Q2_K; its 576-wide rows are Q4_0
    "default": {"Q4_1", "Q8_0"},
}
# The Q2_K mix gives SmolLM2's only rows that are a multiple of 256 (ffn_down's 1536) Q3_K and
# Q3_K_M gives them Q4_K/Q5_K: as llama-quantize's --tensor-type, the odd layers' ffn_down back
# to Q2_K puts both types in one file.
TENSOR_TYPES = {"Q2_K": {r"blk\.\d*[13579]\.ffn_down": "Q2_K"}}


@pytest.fixture(scope="module")
def requantized(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The mix's file, written when a test first asks for it (its time in that test's, and a
    `-k` run of one mix writes one file)."""
    from gguf import GGMLQuantizationType

    from batchserve.bench.gguf_requant import write_requantized
    from batchserve.model.loader import default_model_path

    root = tmp_path_factory.mktemp("requantized")

    @functools.cache
    def get(mix: str) -> Path:
        if mix == "default":
            return default_model_path()
        overrides = {p: GGMLQuantizationType[t] for p, t in TENSOR_TYPES.get(mix, {}).items()}
        return write_requantized(default_model_path(), root / f"smollm2-{mix}.gguf", mix, overrides)

    return get


@pytest.mark.parametrize("mix", list(MIXES))
def test_every_block_type_is_bitwise_the_same_alone_and_in_any_batch(requantized, prompts, mix):
    """The engine reading a GGUF from its blocks (each tensor on its own type's kernel): a request's
    logits alone and in any batch, with drafts, the prefix cache and preemption, bit for bit."""
    from batchserve.model import our_blocks_here

    if not our_blocks_here():
        pytest.skip("our block kernels cannot run here")
    path = requantized(mix)
    llm = _llm(path, None, "none")
    model = llm.engine.runner.model
    assert model.cpu_weights == "gguf" and set(model.gguf_report.native) == MIXES[mix]
    assert llm.engine.facts.batch_invariant, llm.engine.facts.invariance_why
    rows, tokens, problems = _compare(path, None, prompts)
    assert rows == tokens and not problems, problems

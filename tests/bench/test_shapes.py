"""`batchserve bench --shape`: a random-weight model of a named shape, its cost curve and TPOT run,
checked on the tiny shape (the 8B one needs a GPU: only its sizes and its refusal here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from batchserve.bench.curve import load_curve, run_shape, synthetic_profile
from batchserve.bench.shapes import SHAPES, build_model, hf_twin, random_prompts, synthetic_tokenizer
from batchserve.cli import main

TINY = SHAPES["llama3-tiny"]


def test_the_8b_shape_is_llama_3_8b_and_needs_a_gpu() -> None:
    shape = SHAPES["llama3-8b"]
    assert shape.num_params == 8_030_261_248  # Meta-Llama-3-8B's parameter count
    assert shape.kv_bytes_per_token() == 128 * 1024  # 32 layers x K and V x 8 heads x 128 x bf16
    assert not shape.cpu_ok and TINY.cpu_ok
    config = shape.config()
    assert (config.vocab_size, config.num_key_value_heads, config.intermediate_size) == (128256, 8, 14336)


def test_the_tiny_shape_runs_through_the_engine_as_its_hf_twin_generates() -> None:
    from batchserve import LLM, SamplingParams

    model = build_model(TINY, "cpu")
    assert sum(p.numel() for p in model.parameters()) == TINY.num_params
    twin = hf_twin(model)
    # The same tensors: q is the first rows of the merged q|k|v product.
    q, qkv = twin.model.layers[1].self_attn.q_proj.weight, model.layers[1].self_attn.qkv_proj.weight
    assert q.data_ptr() == qkv.data_ptr() and twin.lm_head.weight.data_ptr() == model.lm_head.weight.data_ptr()
    prompts = random_prompts(TINY.vocab_size, 3, 12)
    llm = LLM(draft="none", max_num_seqs=2, hf_model=model, tokenizer=synthetic_tokenizer(TINY.vocab_size))
    ours = [r.token_ids for r in llm.generate(prompts, SamplingParams(max_new_tokens=10))]
    theirs = []
    for p in prompts:
        x = torch.tensor([p])
        with torch.no_grad():
            out = twin.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=10)
        theirs.append(out[0, len(p) :].tolist())
    assert ours == theirs and all(len(o) == 10 for o in ours)  # float32: greedy outputs are HF's


def test_shape_run_writes_the_curve_and_the_tpot_comparison(tmp_path: Path) -> None:
    rows, contexts = (1, 2, 4, 8), (16, 48)
    run = run_shape(TINY, tmp_path, 2, 6, "cpu", rows, contexts, repeats=1, peer="hf", progress=False)
    curve = json.loads((tmp_path / "curve.json").read_text())
    assert curve["shape"]["name"] == "llama3-tiny" and curve["num_params"] == TINY.num_params
    assert curve["rows"] == list(rows) and curve["contexts"] == list(contexts)
    for c in contexts:
        assert len(curve["decode_ms"][str(c)]) == len(rows) and all(ms > 0 for ms in curve["decode_ms"][str(c)])
    profile = load_curve(tmp_path / "curve.json")
    assert profile.token_counts == rows and profile.contexts == contexts
    assert len(profile.per_seq_ms) == len(contexts)
    results = json.loads((tmp_path / "results.json").read_text())
    assert [r["method"] for r in results] == ["none", "hf"] and all(r["output_tokens"] == 12 for r in results)
    assert results[0]["reference_matches"] == 2  # float32 on the CPU: the engine's outputs are HF's
    report = (tmp_path / "report.md").read_text()
    assert report == run.report and "| none |" in report and "--simulate --curve" in report


def test_curves_load_from_a_profile_a_bare_table_or_the_synthetic_name(tmp_path: Path) -> None:
    synthetic = load_curve("synthetic")
    assert synthetic == synthetic_profile()
    assert synthetic.time_ms(64) == synthetic.time_ms(1) and synthetic.time_ms(128) == 2 * synthetic.time_ms(64)
    (tmp_path / "profile.json").write_text(synthetic.to_json())
    assert load_curve(tmp_path / "profile.json") == synthetic
    (tmp_path / "bare.json").write_text(json.dumps({"rows": [1, 8, 64], "ms": [5.0, 5.5, 9.0], "context": 300}))
    bare = load_curve(tmp_path / "bare.json")
    assert bare.token_counts == (1, 8, 64) and bare.contexts == (300,) and bare.time_ms(8) == 5.5
    (tmp_path / "bad.json").write_text(json.dumps({"rows": [1, 2], "ms": [1.0]}))
    for bad in ("bad.json", "missing.json"):
        with pytest.raises(ValueError, match="curve"):
            load_curve(tmp_path / bad)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["bench", "--shape", "gpt-9"], "unknown shape"),
        (["bench", "--shape", "llama3-tiny", "--simulate"], "run them apart"),
        (["bench", "--curve", "synthetic"], "--curve goes with --simulate"),
        (["bench", "--simulate", "--curve", "/no/such/curve.json"], "--curve: cannot read"),
        (["bench", "--simulate", "--curve", "synthetic", "--batch-sizes", "0"], "must be >= 1"),
    ],
)
def test_shape_and_curve_flags_refuse_what_cannot_run(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert says in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_the_8b_shape_says_it_needs_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--shape", "llama3-8b"]) == 2
    err = capsys.readouterr().err
    assert "CUDA" in err and "--shape llama3-tiny" in err

"""`batchserve perplexity`: llama-perplexity's convention (chunks, BOS, the second half scored, the
error), on the forward that serves, against the exact float32 model of the same file."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from batchserve.bench.gguf_write import default_gguf
from batchserve.bench.perplexity import Totals, accumulate, chunks_of, perplexity
from batchserve.cli import main


@pytest.fixture(scope="module")
def text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))[:20000]


def test_chunks_are_whole_ctx_slices_each_beginning_with_bos():
    tokens = list(range(100, 135))
    assert list(chunks_of(tokens, 10, None, 1)) == [[1, *range(101, 110)], [1, *range(111, 120)], [1, *range(121, 130)]]
    assert list(chunks_of(tokens, 10, 2, None)) == [list(range(100, 110)), list(range(110, 120))]
    assert tokens == list(range(100, 135))  # the text's tokens stay as they were


def test_a_uniform_distribution_has_the_vocabularys_perplexity_and_no_error():
    totals, vocab = Totals(), 50
    chunk = list(range(16))
    logp = np.full((16 - 1 - 8, vocab), -math.log(vocab))  # rows 8..14 predict tokens 9..15
    accumulate(totals, chunk, 8, logp, logp)
    assert totals.count == 7
    ppl, err = totals.ppl()
    assert ppl == pytest.approx(vocab) and err < 1e-5
    assert totals.kl() == (pytest.approx(0.0), 0.0) and totals.same_top == 7


def test_the_served_forward_scores_as_the_exact_model_of_the_file(text, tmp_path, monkeypatch, smollm2):
    """Our products quantize activations (as llama.cpp's do): within 2% of the float32 model's
    perplexity on the same chunks and positions (0.3% apart on 2,040 tokens of this text); a
    position scored off by one is far outside."""
    from batchserve.bench.perplexity import bos_of

    monkeypatch.setenv("BATCHSERVE_CACHE_DIR", str(tmp_path))
    path = str(default_gguf())
    ctx, first, chunks = 128, 64, 4
    ours = perplexity(path, text, ctx, chunks)
    assert ours.chunks == chunks and ours.tokens_scored == chunks * (ctx - 1 - first) and ours.ppl_error > 0
    model, tokenizer = smollm2  # the session's `load_model(None, "float32")`: transformers' load of this file
    assert model.gguf_source == path
    bos = bos_of(path)
    tokens = tokenizer.encode(text, add_special_tokens=False)
    tokens = tokens if bos is None else [bos, *tokens]
    nll, shifted = [], []
    with torch.no_grad():
        for chunk in chunks_of(tokens, ctx, chunks, bos):
            logp = torch.log_softmax(model(torch.tensor([chunk])).logits[0].double(), -1)  # [ctx, V]
            nll += [-logp[j, chunk[j + 1]].item() for j in range(first, ctx - 1)]
            shifted += [-logp[j, chunk[j]].item() for j in range(first, ctx - 1)]
    exact = math.exp(sum(nll) / len(nll))
    assert abs(ours.ppl / exact - 1) < 0.02, (ours.ppl, exact)
    assert abs(math.exp(sum(shifted) / len(shifted)) / exact - 1) > 0.5


def test_the_command_prints_llama_perplexitys_line_and_the_kl_divergence(text, tmp_path, capsys):
    source, out = tmp_path / "text.txt", tmp_path / "ppl.json"
    source.write_text(text)
    path = str(default_gguf())
    args = ["perplexity", path, "--text", str(source), "--ctx", "64", "--chunks", "2", "--json", str(out)]
    assert main([*args, "--kl-divergence", path]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("Final estimate: PPL = ") and "Mean KLD: 0.000000" in printed
    result = json.loads(out.read_text())
    assert result["kl_divergence"] == 0 and result["same_top_p"] == 1.0 and result["tokens_scored"] == 2 * 31
    assert main(["perplexity", path, "--text", str(source), "--ctx", "63"]) == 2
    short = tmp_path / "short.txt"
    short.write_text("a few words")
    assert main(["perplexity", path, "--text", str(short), "--ctx", "64"]) == 2
    assert "needs at least 128" in capsys.readouterr().err

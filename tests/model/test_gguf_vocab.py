"""The ids that end a generation, read from a GGUF file as llama.cpp reads them."""

from __future__ import annotations

from batchserve.bench.gguf_write import default_gguf
from batchserve.model.gguf_vocab import end_of_generation_ids, file_end_of_generation_ids


def _vocab(*texts: str) -> list[str]:
    return ["<unk>", "<s>", "</s>", *texts, "hello"]


def test_the_metadatas_eos_eot_eom_and_fim_ids_end_a_generation():
    meta = {
        "tokenizer.ggml.tokens": _vocab("a", "b", "c", "d"),
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.eot_token_id": 3,
        "tokenizer.ggml.eom_token_id": 4,
        "tokenizer.ggml.fim_pad_token_id": 5,
        "tokenizer.ggml.bos_token_id": 1,
    }
    assert end_of_generation_ids(meta) == {2, 3, 4, 5}


def test_chat_templates_end_tokens_end_a_generation_by_their_text():
    # Llama 3's end of turn and end of message (a tool call), Phi-3's end, ChatML's end.
    tokens = _vocab("<|eot_id|>", "<|eom_id|>", "<|end|>", "<|im_end|>", "<|start_header_id|>")
    ids = end_of_generation_ids({"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.eos_token_id": 2})
    assert ids == {2, 3, 4, 5, 6}


def test_end_is_a_messages_end_where_return_and_call_exist():
    """gpt-oss's harmony format: <|end|> closes a message, <|return|> and <|call|> the generation."""
    tokens = _vocab("<|end|>", "<|return|>", "<|call|>")
    assert end_of_generation_ids({"tokenizer.ggml.tokens": tokens}) == {4, 5}


def test_the_default_models_file_ends_at_im_end_and_endoftext():
    ids = file_end_of_generation_ids(default_gguf())
    assert ids == {0, 2}  # <|endoftext|>, <|im_end|> (its eos)

"""gpt-oss through the OpenAI API: its chat template (llama.cpp's copy of the model's) renders, its
harmony output's `analysis` channel is `reasoning_content` and `final` is `content`, whole and
streamed (the two never in one delta), with the markup out of both whatever the pieces it comes
in; a chat call on a harmony vocabulary keeps the special tokens' text for that split; a forced
call is written in harmony's markup."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from batchserve.detokenize import Detokenizer
from batchserve.request import FinishReason, RequestOutput, RequestStats
from batchserve.server.openai.answers import Answer, AnswerView, Sample
from batchserve.server.openai.channels import MOST_HEADER_CHARS, ChannelSplit, harmony_markup, split_channels
from batchserve.server.openai.logprobs import TokenText
from tests.conftest import make_tiny_model, make_tiny_tokenizer
from tests.model.test_gguf_tokenizer import VOCAB_DIR
from tests.server.test_openai_api import _client

MARKERS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"]
THINKING, ANSWER = "The user greets; answer < 5 words | <| kindly.", "Hello <there>!"
HARMONY = (
    f"<|channel|>analysis<|message|>{THINKING}<|end|><|start|>assistant<|channel|>final<|message|>{ANSWER}<|return|>"
)


def harmony_tokenizer() -> Any:
    """The tiny byte tokenizer with gpt-oss's markers as special tokens of their own."""
    tok = make_tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": MARKERS})
    return tok


def _pieces(text: str, every: int) -> list[str]:
    return [text[i : i + every] for i in range(0, len(text), every)]


def test_the_analysis_is_reasoning_and_the_final_channel_content_in_any_pieces():
    assert split_channels(HARMONY) == split_channels(HARMONY)  # a dataclass: compared by value
    whole = split_channels(HARMONY)
    assert (whole.reasoning, whole.content) == (THINKING, ANSWER)
    for every in (1, 2, 3, 7, len(HARMONY)):  # markers cut anywhere
        split, reasoning, content = ChannelSplit(), "", ""
        for piece in [*_pieces(HARMONY, every), None]:
            out = split.flush() if piece is None else split.feed(piece)
            reasoning, content = reasoning + out.reasoning, content + out.content
        assert (reasoning, content) == (THINKING, ANSWER), every


def test_text_without_harmony_is_content_and_a_cut_header_is_dropped():
    assert split_channels("plain <b>text</b> <|not a marker|>").content == "plain <b>text</b> <|not a marker|>"
    long = "x" * (MOST_HEADER_CHARS + 10)  # a header that never opens a message is not held unbounded
    split = ChannelSplit()
    assert split.feed(long).content == long and split.feed("more").content == "more"
    # Cut by max_tokens inside the next header: what the header held is never shown.
    cut = split_channels("<|channel|>analysis<|message|>hm<|end|><|start|>assistant<|channel|>fin")
    assert (cut.reasoning, cut.content) == ("hm", "")
    # A preamble to the user is content; a message to a function is a call, never text.
    assert split_channels("<|channel|>commentary<|message|>Checking.<|end|>").content == "Checking."
    call = split_channels('<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": 1}<|call|>')
    assert (call.reasoning, call.content, call.calls) == ("", "", [("f", '{"a": 1}')])


def _output(text: str, finished: bool) -> RequestOutput:
    reason = FinishReason.EOS if finished else None
    return RequestOutput("r", [1], text, finished, reason, 3, 1, RequestStats())


async def _aiter(items: list[Any]) -> Any:
    for item in items:
        yield item


async def test_chat_answers_carry_reasoning_content_whole_and_streamed_apart():
    tok = harmony_tokenizer()
    answer = Answer("chatcmpl-1", "m", AnswerView(chat=True, channels=True), TokenText(tok))
    sample = Sample(0, texts=[HARMONY], last=_output("", True))
    message = answer.whole([sample], [sample])["choices"][0]["message"]
    assert message == {"role": "assistant", "content": ANSWER, "reasoning_content": THINKING}

    outputs = [(0, _output(p, False)) for p in _pieces(HARMONY, 5)]
    outputs[-1] = (0, _output(outputs[-1][1].new_text, True))
    events = [e async for e in answer.stream(outputs[0], _aiter(outputs[1:]), include_usage=False)]
    deltas = [json.loads(e.removeprefix("data: "))["choices"][0]["delta"] for e in events[:-1]]
    assert events[-1] == "data: [DONE]\n\n"
    assert all(not ("reasoning_content" in d and "content" in d) for d in deltas)  # never in one delta
    assert "".join(d.get("reasoning_content", "") for d in deltas) == THINKING
    assert "".join(d.get("content", "") for d in deltas) == ANSWER


def test_a_harmony_vocabulary_keeps_the_markups_text_only_when_asked():
    tok = harmony_tokenizer()
    assert harmony_markup(tok) and not harmony_markup(make_tiny_tokenizer())
    ids = tok(HARMONY, add_special_tokens=False).input_ids
    assert {tok.convert_tokens_to_ids(m) for m in MARKERS} & set(ids)  # one id a marker
    detok = Detokenizer(tok)
    for request_id, skip in (("kept", False), ("skipped", True)):
        detok.start(request_id, (), skip_special=skip)
        for i in ids:
            detok.on_token(request_id, i)
    assert detok.take("kept", True) == HARMONY
    plain = HARMONY
    for marker in MARKERS:
        plain = plain.replace(marker, "")
    assert detok.take("skipped", True) == plain


def test_the_models_own_chat_template_renders():
    path = VOCAB_DIR / "openai-gpt-oss-120b.jinja"
    if not path.is_file():
        pytest.skip(f"llama.cpp's gpt-oss template is not at {VOCAB_DIR} (scripts/llama_vocab.py fetches it)")
    from batchserve.config import LimitsConfig
    from batchserve.text import TextCodec

    tok = harmony_tokenizer()
    tok.chat_template = path.read_text()
    codec = TextCodec(tok, vocab_size=len(tok), max_model_len=4096, limits=LimitsConfig())
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
    ]
    text = tok.decode(list(codec.render_chat(messages)), skip_special_tokens=False)
    assert text.startswith("<|start|>system<|message|>") and "<|start|>developer<|message|># Instructions" in text
    assert "Be brief." in text and text.endswith("<|start|>user<|message|>Bye<|end|><|start|>assistant")


@pytest.fixture
async def harmony_api():
    """A server whose tokenizer speaks harmony, over the tiny model (its vocabulary grown to the markers)."""
    from batchserve.config import CacheConfig, DraftConfig, EngineConfig, SchedulerConfig
    from batchserve.engine import EngineCore
    from tests.server.conftest import CHAT_TEMPLATE, start_server

    tok = harmony_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    config = EngineConfig(
        cache=CacheConfig(block_size=4, num_blocks=256),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256),
        draft=DraftConfig(decoding_length=8, adaptive=False),
    )
    r = await start_server(EngineCore(config, make_tiny_model(vocab_size=len(tok)), tok), http=True, metrics_port=0)
    yield r
    await r.channel.close()
    await r.server.shutdown()


async def test_a_chat_call_keeps_the_markup_a_completion_does_not(harmony_api):
    """The chat answer is split from the text with the special tokens' (every marker the model
    writes: here forced by a logit bias, so the whole answer is markup and nothing is shown); a
    legacy completion's text is the model's text without them, as before."""
    engine, seen = harmony_api.server.engine, []
    generate = engine.generate

    def spy(sub: Any) -> Any:
        seen.append(sub.params.skip_special_tokens)
        return generate(sub)

    engine.generate = spy
    client, tok = _client(harmony_api), harmony_tokenizer()
    bias = {str(tok.convert_tokens_to_ids("<|end|>")): 100}
    chat = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, logit_bias=bias
    )
    message = chat.choices[0].message
    assert message.content == "" and getattr(message, "reasoning_content", "missing") is None
    done = await client.completions.create(model="tiny", prompt="hi", max_tokens=4, logit_bias=bias)
    assert done.choices[0].text == ""
    assert seen == [False, True]


CALL = (
    "<|channel|>analysis<|message|>The user wants the weather.<|end|>"
    '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
    "<|call|>"
)


async def test_a_message_to_a_function_is_a_tool_call_whole_and_streamed():
    assert split_channels(CALL).calls == [("get_weather", '{"city": "Paris"}')]
    # The recipient may stand after the role instead; a call cut by max_tokens keeps what it had.
    cut = split_channels('<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{"a": ')
    assert (cut.content, cut.calls) == ("", [("f", '{"a": ')])
    answer = Answer("chatcmpl-2", "m", AnswerView(chat=True, channels=True), TokenText(harmony_tokenizer()))
    sample = Sample(0, texts=[CALL], last=_output("", True))
    choice = answer.whole([sample], [sample])["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert choice["message"]["content"] is None and choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] == "The user wants the weather."

    outputs = [(0, _output(p, False)) for p in _pieces(CALL, 4)]
    outputs[-1] = (0, _output(outputs[-1][1].new_text, True))
    events = [e async for e in answer.stream(outputs[0], _aiter(outputs[1:]), include_usage=False)]
    chunks = [json.loads(e.removeprefix("data: "))["choices"][0] for e in events[:-1]]
    calls = [c for chunk in chunks for c in chunk["delta"].get("tool_calls", [])]
    assert [(c["index"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        (0, "get_weather", '{"city": "Paris"}')
    ]
    assert chunks[-1]["finish_reason"] == "tool_calls" and not "".join(c["delta"].get("content") or "" for c in chunks)


async def test_the_responses_api_gives_the_final_text_and_the_calls_as_items():
    from batchserve.server.openai.responses import ResponseAnswer
    from batchserve.server.openai.responses_bodies import ResponsesRequest

    answer = ResponseAnswer(ResponsesRequest(model="m", input="x"), "m", None, channels=True)
    items = answer.whole(CALL, _output("", True))["output"]
    assert [i["type"] for i in items] == ["function_call"]
    assert (items[0]["name"], items[0]["arguments"]) == ("get_weather", '{"city": "Paris"}')
    (message,) = ResponseAnswer(ResponsesRequest(model="m", input="x"), "m", None, True).whole(
        HARMONY, _output("", True)
    )["output"]
    assert message["content"][0]["text"] == ANSWER
    outputs = [(0, _output(p, False)) for p in _pieces(CALL, 6)]
    outputs[-1] = (0, _output(outputs[-1][1].new_text, True))
    events = [e async for e in answer.stream(outputs[0][1], _aiter(outputs[1:]))]
    done = [json.loads(e.split("data: ", 1)[1]) for e in events if e.startswith("event: response.output_item.done")]
    assert [d["item"]["name"] for d in done if d["item"]["type"] == "function_call"] == ["get_weather"]
    assert not any("output_text.delta" in e for e in events)  # nothing of the markup or the call as text


MODE_SCHEMA = {"type": "object", "properties": {"mode": {"enum": ["fast", "slow"]}}, "required": ["mode"]}
COLOR_SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "blue"]}}, "required": ["color"]}
TOOLS = [
    {"type": "function", "function": {"name": "set_mode", "parameters": MODE_SCHEMA}},
    {"type": "function", "function": {"name": "pick_color", "parameters": COLOR_SCHEMA}},
]
HARMONY_CALL = (
    "<|channel|>analysis<|message|>Pick one.\n<|end|><|start|>assistant"
    '<|channel|>commentary to=functions.set_mode <|constrain|>json<|message|>{"mode": "fast"}<|call|>'
)


@pytest.mark.parametrize(
    ("choice", "text", "ok"),
    [
        ("required", HARMONY_CALL, True),
        ("required", HARMONY_CALL[HARMONY_CALL.index("<|start|>") + len("<|start|>assistant") :], True),  # no analysis
        ("required", HARMONY_CALL.replace('"fast"', '"warp"'), False),  # arguments outside the schema
        ("required", HARMONY_CALL.replace("set_mode", "reboot"), False),  # no such function
        ("required", HARMONY_CALL.replace("<|call|>", ""), False),  # not ended yet
        ("required", '<tool_call>\n{"name": "set_mode", "arguments": {"mode": "fast"}}\n</tool_call>', False),
        ("required", HARMONY.replace("<|return|>", ""), False),  # an answer, not a call
        ("pick_color", HARMONY_CALL, False),
        (
            "pick_color",
            HARMONY_CALL.replace("set_mode", "pick_color").replace('"mode": "fast"', '"color": "red"'),
            True,
        ),
    ],
)
def test_a_forced_call_on_a_harmony_model_is_a_harmony_message_to_the_function(choice, text, ok):
    """On a harmony model "required" and a named function force one call in gpt-oss's own markup
    (its markers as special tokens), after an analysis if the model writes one; never our
    `<tool_call>` layout, never an answer."""
    from batchserve.grammar.compiler import GrammarCompiler
    from batchserve.grammar.matcher import GrammarError
    from batchserve.server.openai.tools import parse_tool_request

    tok = harmony_tokenizer()
    named = {"type": "function", "function": {"name": choice}}
    tools = parse_tool_request(TOOLS, choice if choice == "required" else named, None, 65536)
    assert tools is not None
    constraint = replace(tools, harmony=True).constraint()
    assert constraint is not None and "<tool_call>" not in constraint.spec
    assert "<tool_call>" in (tools.constraint() or constraint).spec  # elsewhere: our layout, as before
    compiler = GrammarCompiler(tok, len(tok), max_chars=65536)
    g = compiler.matcher(compiler.compile(constraint))
    try:
        g.commit(tok.encode(text, add_special_tokens=False))
    except GrammarError:
        assert not ok
        return
    assert g.done == ok


async def test_a_harmony_model_forced_to_call_answers_with_tool_calls(harmony_api):
    client, tok = _client(harmony_api), harmony_tokenizer()
    bias = {str(tok.convert_tokens_to_ids("<|end|>")): 100}  # an analysis, where one is written, ends at once
    for choice, want in (("required", None), ({"type": "function", "function": {"name": "pick_color"}}, "pick_color")):
        chat = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "go"}], tools=TOOLS, tool_choice=choice,
            max_tokens=96, logit_bias=bias, temperature=0,
        )  # fmt: skip
        choice0 = chat.choices[0]
        assert choice0.finish_reason == "tool_calls" and choice0.message.content is None, choice0
        (call,) = choice0.message.tool_calls
        args = json.loads(call.function.arguments)
        assert call.function.name == (want or call.function.name) and call.function.name in ("set_mode", "pick_color")
        assert args in ({"mode": "fast"}, {"mode": "slow"}, {"color": "red"}, {"color": "blue"})

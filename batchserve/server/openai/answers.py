"""The OpenAI API's answers: choices collected from a call's samples (`n`, `best_of`), usage that
counts the prompt once, and the finish reasons; the HTTP plumbing is `api`'s."""

from __future__ import annotations

import functools
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from batchserve.request import FinishReason, RequestOutput, TokenLogprob
from batchserve.server.frontend import EngineFailed
from batchserve.server.openai.channels import ChannelSplit, Split, joined, split_channels
from batchserve.server.openai.logprobs import TokenText, chat_logprobs, completion_logprobs
from batchserve.server.openai.tools import ChatTools, ToolStream, as_call
from batchserve.text import TextCodec

# Runs a rendering beside the event loop (`Frontend.render`).
Render = Callable[[Callable[[], list[str]]], Awaitable[list[str]]]

FINISH = {
    FinishReason.LENGTH: "length",
    FinishReason.EOS: "stop",
    FinishReason.STOP_SEQUENCE: "stop",
    FinishReason.CANCELLED: "abort",
    FinishReason.ERROR: "error",
    FinishReason.CONSTRAINT_FAILED: None,  # no finish: the answer ends in an error (`constraint_failure`)
}


def constraint_failure(out: RequestOutput) -> str | None:
    """Why `out` ended where its grammar admitted no continuation (None: it did not). Not an OpenAI
    finish reason (strict clients refuse any other): whole answers are a 400 naming
    `response_format`, streams end with an error event after the text so far."""
    if out.finished and out.finish_reason is FinishReason.CONSTRAINT_FAILED:
        return out.error or "structured output failed"
    return None


def constraint_error_event(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error", "param": "response_format", "code": None}}


def finish_reason(out: RequestOutput) -> str | None:
    """OpenAI's finish reason of a finished output; None before the end."""
    return FINISH[out.finish_reason] if out.finished and out.finish_reason else None


@dataclass(slots=True)
class Sample:
    """One sample's outputs so far (a choice of the answer, or one of best_of's candidates)."""

    index: int
    texts: list[str] = field(default_factory=list)
    last: RequestOutput | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None

    def add(self, out: RequestOutput) -> None:
        self.texts.append(out.new_text)
        if out.new_logprobs is not None:  # appended in place: a long answer's logprobs are not copied per output
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(out.new_logprobs)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.last = out

    @property
    def text(self) -> str:
        return "".join(self.texts)

    @property
    def cumulative_logprob(self) -> float:
        """The sum of its tokens' logprobs (best_of's ranking; the model's raw distribution)."""
        return sum(e.logprob for e in self.logprobs or ())


def best(samples: Sequence[Sample], n: int) -> list[Sample]:
    """The `n` samples of highest cumulative logprob, best first (`best_of`); all of them, in
    order, when there are only `n`."""
    if len(samples) == n:
        return list(samples)
    return sorted(samples, key=lambda s: -s.cumulative_logprob)[:n]


def usage(indexed: Sequence[tuple[int, RequestOutput]], per_prompt: int = 1) -> dict[str, Any]:
    """The usage of a call whose samples (by index in the call) ended with these outputs: each
    prompt counted once (it was computed once for its `per_prompt` samples), every sample's
    completion tokens (best_of's unshown ones too: they ran). `resumed_tokens` (an extra): of the
    completion tokens, those the call carried in `resume_token_ids`, input to count with the prompt."""
    outputs = [o for _, o in indexed]
    by_prompt: dict[int, list[RequestOutput]] = {}
    for i, o in indexed:
        by_prompt.setdefault(i // per_prompt, []).append(o)
    prompt = sum(group[0].num_prompt_tokens for group in by_prompt.values())
    # Found cached before the call: a sibling's reuse of its prompt's first sample's blocks is not.
    cached = sum(min(o.stats.cached_prompt_tokens for o in group) for group in by_prompt.values())
    completion = sum(o.num_output_tokens for o in outputs)
    steps = sum(o.stats.steps for o in outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "resumed_tokens": sum(o.stats.resumed_tokens for o in outputs),
        "completion_tokens_details": {
            "accepted_prediction_tokens": sum(o.stats.accepted_prediction_tokens for o in outputs),
            "rejected_prediction_tokens": sum(o.stats.rejected_prediction_tokens for o in outputs),
        },
        "speculation": {  # batchserve's extension
            "steps": steps,
            "draft_tokens_proposed": sum(o.stats.draft_tokens_proposed for o in outputs),
            "draft_tokens_accepted": sum(o.stats.draft_tokens_accepted for o in outputs),
            "tokens_per_step": completion / steps if steps else 0.0,
        },
    }


@dataclass(slots=True)
class EchoPrompt:
    """Completions' `echo`: the prompt, shown before each completion. `tokenize` is the call's
    prompt preparation (off the event loop); it keeps the ids and, for ids sent as such, their text."""

    prompt: str | list[int]
    text: str = ""
    ids: list[int] = field(default_factory=list)

    def tokenize(self, codec: TextCodec) -> list[int]:
        self.ids = codec.tokenize(self.prompt)
        self.text = self.prompt if isinstance(self.prompt, str) else codec.tokenizer.decode(self.ids)
        return self.ids


@dataclass(frozen=True, slots=True)
class AnswerView:
    """How a call's samples are shown: chat or completion, with logprobs or not, the prompt
    echoed (completions), tool calls parsed out (chat)."""

    chat: bool
    logprobs: bool = False
    echoes: tuple[EchoPrompt, ...] | None = None  # each prompt's, for a list of prompts
    tools: ChatTools | None = None
    per_prompt: int = 1  # samples of each prompt: sample i answers prompt i // per_prompt
    channels: bool = False  # gpt-oss's harmony markup: `analysis` is reasoning_content (`channels.py`)

    def echo(self, sample: int) -> EchoPrompt | None:
        """The echoed prompt that sample `sample` (its index in the call) answers."""
        return self.echoes[sample // self.per_prompt] if self.echoes is not None else None


@dataclass(slots=True)
class _Streamed:
    """One choice's state in a stream."""

    offset: int = 0  # characters of its tokens' text so far (completions' text_offset)
    tools: ToolStream | None = None
    channels: ChannelSplit | None = None
    calls: list[dict[str, Any]] = field(default_factory=list)  # gpt-oss's, sent with the finish
    last: RequestOutput | None = None


class Answer:
    """The body (or the server-sent events) of one call's answer."""

    def __init__(self, rid: str, model: str, view: AnswerView, token_text: TokenText) -> None:
        self.rid, self.model, self.view, self.token_text = rid, model, view, token_text
        self.created = int(time.time())
        self.include_usage = False
        # The object of a whole answer and of a chunk.
        self.kind = ("chat.completion", "chat.completion.chunk") if view.chat else ("text_completion",) * 2

    def _logprobs(self, entries: list[TokenLogprob] | None, offset: int = 0, echoed: EchoPrompt | None = None) -> Any:
        """A choice's (or chunk's) logprobs where shown; `echoed`: the entries start with this prompt's."""
        if not self.view.logprobs or (entries is None and echoed is None):
            return None
        if self.view.chat:
            return chat_logprobs(entries or [], self.token_text)
        first = echoed.ids[0] if echoed is not None else None
        return completion_logprobs(entries or [], self.token_text, offset, first)

    def whole(self, chosen: Sequence[Sample], samples: Sequence[Sample]) -> dict[str, Any]:
        """The JSON answer: `chosen` as its choices; usage counts every one of `samples`."""
        choices = []
        echoed: dict[int, Any] = {}  # a shared sample's copies (max_tokens 0) show one logprobs object
        for i, s in enumerate(chosen):
            assert s.last is not None
            choice: dict[str, Any] = {"index": i, "finish_reason": finish_reason(s.last)}
            echo = self.view.echo(s.index)
            if self.view.chat:
                choice["logprobs"] = self._logprobs(s.logprobs)
                split = split_channels(s.text) if self.view.channels else Split(content=s.text)
                choice["message"] = {"role": "assistant", "content": split.content}
                if self.view.tools is not None:
                    parsed = self.view.tools.parse(split.content)
                    choice["message"] = parsed.message()
                    choice["finish_reason"] = parsed.finish_reason(choice["finish_reason"])
                if self.view.channels:  # gpt-oss: its analysis, and its calls to functions
                    choice["message"]["reasoning_content"] = split.reasoning or None
                    if split.calls:
                        message = choice["message"]
                        message["tool_calls"] = message.get("tool_calls", []) + [as_call(*c) for c in split.calls]
                        message["content"] = message["content"] or None
                        choice["finish_reason"] = _called(choice["finish_reason"])
            elif echo is not None:
                choice["text"] = echo.text + s.text
                if id(s.last) not in echoed:
                    entries = (s.prompt_logprobs or []) + (s.logprobs or [])
                    echoed[id(s.last)] = self._logprobs(entries, echoed=echo)
                choice["logprobs"] = echoed[id(s.last)]
            else:
                choice["text"] = s.text
                choice["logprobs"] = self._logprobs(s.logprobs)
            choices.append(choice)
        outputs = [(s.index, s.last) for s in samples if s.last is not None]
        return self._envelope(self.kind[0], choices) | {"usage": usage(outputs, self.view.per_prompt)}

    async def stream(
        self,
        first: tuple[int, RequestOutput],
        outputs: AsyncIterator[tuple[int, RequestOutput]],
        include_usage: bool,
        render: Render | None = None,
    ) -> AsyncIterator[str]:
        """Server-sent events in OpenAI's chunk format (each choice's chunks carry its `index`),
        then `data: [DONE]`. A client that disconnects cancels this generator, and closing
        `outputs` aborts the requests. `render`: where chunks with logprobs are rendered (the
        front end's render thread: up to 21 entries a token, n samples, never on the event loop)."""
        self.include_usage = include_usage
        states: dict[int, _Streamed] = {}
        try:
            item: tuple[int, RequestOutput] | None = first
            while item is not None:
                i, out = item
                step = functools.partial(self._step, i, out, states)
                heavy = render is not None and (out.new_logprobs or (i not in states and out.prompt_logprobs))
                for event in await render(step) if heavy and render is not None else step():
                    yield event
                if (failure := constraint_failure(out)) is not None:
                    yield _sse(constraint_error_event(failure))
                    break
                item = await anext(outputs, None)
            if include_usage:
                lasts = [(i, s.last) for i, s in sorted(states.items()) if s.last is not None]
                yield _sse(self._envelope(self.kind[1], []) | {"usage": usage(lasts, self.view.per_prompt)})
        except EngineFailed as e:
            yield _sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": None}})
        finally:
            await outputs.aclose()  # type: ignore[attr-defined]
        yield "data: [DONE]\n\n"

    def _step(self, i: int, out: RequestOutput, states: dict[int, _Streamed]) -> list[str]:
        """The chunks of one output of choice `i`: its opening chunks if it is the first."""
        events = []
        if i not in states:
            states[i] = _Streamed(
                tools=self.view.tools.stream() if self.view.tools is not None else None,
                channels=ChannelSplit() if self.view.channels else None,
            )
            events = self._opening(i, out, states[i])
        return events + self._events(i, out, states[i])

    def _opening(self, i: int, out: RequestOutput, state: _Streamed) -> list[str]:
        """A choice's first chunks: chat's role; completions' echoed prompt (and its logprobs)."""
        if self.view.chat:
            return [self._chunk(i, "", None, role=True)]
        echo = self.view.echo(i)
        if echo is None:
            return []
        state.offset = sum(len(self.token_text(t)) for t in echo.ids)
        return [self._chunk(i, echo.text, None, self._logprobs(out.prompt_logprobs or [], echoed=echo))]

    def _events(self, i: int, out: RequestOutput, state: _Streamed) -> list[str]:
        """The chunks of one output of choice `i`: its text (less what may be a tool call) and
        logprobs; at its end, its tool calls and finish reason."""
        state.last = out
        finish = finish_reason(out)
        logprobs = self._logprobs(out.new_logprobs, state.offset) if out.new_logprobs else None
        state.offset += sum(len(self.token_text(e.token_id)) for e in out.new_logprobs or ())
        text, calls, reasoning = out.new_text, None, ""
        if state.channels is not None:  # gpt-oss: its analysis apart, the markup out, its calls kept
            split = state.channels.feed(text)
            if finish is not None:
                split = joined(split, state.channels.flush())
            text, reasoning = split.content, split.reasoning
            state.calls += [as_call(*c) for c in split.calls]
        if state.tools is not None:
            text = state.tools.feed(text)
            if finish is not None:
                tail = state.tools.flush()
                text, calls, finish = text + tail.content, tail.tool_calls, tail.parse.finish_reason(finish)
        events = [self._chunk(i, "", None, reasoning=reasoning)] if reasoning else []
        if finish is not None and state.calls:  # gpt-oss's calls, after any the tools parser found
            first = len(calls or [])
            calls = [*(calls or []), *({"index": first + k, **c} for k, c in enumerate(state.calls))]
            finish = _called(finish)
        if calls:  # the text first, then the calls with the finish reason
            if text or logprobs is not None:
                events.append(self._chunk(i, text, None, logprobs))
            return [*events, self._chunk(i, "", finish, calls=calls)]
        if text or finish is not None or logprobs is not None:
            events.append(self._chunk(i, text, finish, logprobs))
        return events

    def _chunk(
        self,
        i: int,
        text: str,
        finish: str | None,
        logprobs: Any = None,
        role: bool = False,
        calls: Any = None,
        reasoning: str = "",
    ) -> str:
        choice: dict[str, Any] = {"index": i, "finish_reason": finish, "logprobs": logprobs}
        if self.view.chat:
            choice["delta"] = {"role": "assistant", "content": text} if role else {"content": text}
            if reasoning:  # gpt-oss's analysis channel, in chunks of its own
                choice["delta"] = {"reasoning_content": reasoning}
            if calls:
                choice["delta"] = {"tool_calls": calls}
            elif finish is not None and not text:
                choice["delta"] = {}
        else:
            choice["text"] = text
        data = self._envelope(self.kind[1], [choice])
        return _sse(data | {"usage": None} if self.include_usage else data)

    def _envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.rid, "object": kind, "created": self.created, "model": self.model, "choices": choices}


def _called(reason: str | None) -> str | None:
    """OpenAI's "tool_calls" where the model stopped after calling (a cut call keeps "length")."""
    return "tool_calls" if reason == "stop" else reason


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

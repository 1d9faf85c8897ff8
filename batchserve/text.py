"""Text into the engine: tokenize, chat templates, every input bounded before it is tokenized.
The output's text (incremental detokenizing, stop strings) is `detokenize.py`'s."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from batchserve.config import LimitsConfig

Prompt = str | Sequence[int]
CHAT_ROLES = ("system", "user", "assistant", "tool")
ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system role
# How a model without a tools-aware template is told to call a function, and shown its result
# (Hermes-style tags, which tools-trained ChatML models already know).
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
TOOLS_PROMPT = (
    "You can call the functions below, described one JSON object per line:\n"
    "{functions}\n\n"
    "To call one, reply with this block, one block per call:\n"
    f"{TOOL_CALL_OPEN}\n"
    '{{"name": "<function name>", "arguments": <the arguments as a JSON object>}}\n'
    f"{TOOL_CALL_CLOSE}\n"
    f"Each call's result then comes back to you between {TOOL_RESPONSE_OPEN} and {TOOL_RESPONSE_CLOSE}."
)


class TokenIds(list[int]):
    """Token ids a `TextCodec` made (a text tokenized, a chat rendered) or checked: every one in
    the model's vocabulary. Checked once: admission measures them against the context again
    (a length) but never id by id; the front end did that off the event loop."""


# Text longer than this many characters a token of context is tokenized head first (`_encode`).
PROBE_CHARS_PER_TOKEN = 4
# Tokens the cut of the head may add (a word split in two) beyond what the whole text has there.
HEAD_SLACK = 64


class TextCodec:
    """One tokenizer's input handling for the engine, with every input bounded before it is tokenized."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int, limits: LimitsConfig) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.limits = limits

    # ---- input -----------------------------------------------------------------------------

    def tokenize(self, prompt: Prompt, field: str = "prompt") -> TokenIds:
        """Token ids of a text prompt, or a checked copy of a token-id prompt (`field`: the name a
        refusal gives it)."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            self.check_text_size(len(prompt), field)
            ids = self._encode(prompt, True, field)
            if len(ids) >= self.max_model_len:
                raise ValueError(
                    f"{field}: {len(ids)} tokens; the model's context is {self.max_model_len}, "
                    "which must also hold at least one new token"
                )
            return ids
        # The length first: no per-id work (on whichever thread) for a prompt that cannot fit.
        if len(prompt) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt)} tokens; the model's context is {self.max_model_len}, "
                "which must also hold at least one new token"
            )
        if isinstance(prompt, TokenIds):
            return TokenIds(prompt)  # checked id by id where it was made
        ids = TokenIds(prompt)
        vocab = self.vocab_size
        if not all(type(t) is int and 0 <= t < vocab for t in ids):
            bad = next(t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab)
            raise ValueError(f"prompt_token_ids: {bad!r} is not a token id in [0, {vocab})")
        return ids

    def _encode(self, text: str, special: bool, field: str) -> TokenIds:
        """The tokenizer's ids of `text`, bounded in tokens, not characters: a text that may not fit
        (over PROBE_CHARS_PER_TOKEN characters a token of context) has its head tokenized first,
        and one whose head alone is past the context (HEAD_SLACK for the tokens the cut may split)
        is refused there, its tail never tokenized: dense text (CJK, ~1 token a character) costs
        the tokenize thread a context's worth of work, not the whole body's."""
        probe = self.max_model_len * PROBE_CHARS_PER_TOKEN
        if len(text) > probe:
            head = len(self.tokenizer(text[:probe], add_special_tokens=special).input_ids)
            if head > self.max_model_len + HEAD_SLACK:
                raise ValueError(
                    f"{field}: its first {probe} characters alone are {head} tokens; the model's context is "
                    f"{self.max_model_len}"
                )
        return self._made(self.tokenizer(text, add_special_tokens=special).input_ids)

    def _made(self, ids: Sequence[int]) -> TokenIds:
        """The tokenizer's ids, refused where a tokenizer larger than the model made one past its vocabulary."""
        made = TokenIds(ids)
        if made and max(made) >= self.vocab_size:
            raise ValueError(f"the tokenizer made token {max(made)}, past the model's vocabulary of {self.vocab_size}")
        return made

    def inputs(
        self, prompt: Prompt, references: Sequence[Prompt], stop: Sequence[str], stop_token_ids: Sequence[int]
    ) -> tuple[TokenIds, list[TokenIds]]:
        """A request's text checked at admission, cheapest bound first: its stops, then its prompt's
        ids (a text tokenized; ids checked against the vocabulary and the context), its references'."""
        self.check_stop(stop, stop_token_ids)
        ids = self.tokenize(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        return ids, self.tokenize_references(references)

    def tokenize_references(self, references: Sequence[Prompt], field: str = "references") -> list[TokenIds]:
        """Token ids of a request's references (texts, tokenized on their own without special
        tokens, or token ids), the empty ones dropped. Bounded like a prompt, on a bound of
        their own: at most `max_references`, their text within a prompt's characters before
        any is tokenized, and their tokens together at most the context."""
        limit = self.limits.max_references
        if len(references) > limit:
            raise ValueError(f"{field}: {len(references)} references, at most {limit}")
        self.check_text_size(sum(len(r) for r in references if isinstance(r, str)), field)
        out: list[TokenIds] = []
        total = 0
        for i, ref in enumerate(references):
            if isinstance(ref, str):
                ids = self._made(self.tokenizer(ref, add_special_tokens=False).input_ids) if ref else TokenIds()
            elif total + len(ref) <= self.max_model_len:  # the length first, as for a prompt
                ids = TokenIds(ref)
                if not isinstance(ref, TokenIds) and not all(type(t) is int and 0 <= t < self.vocab_size for t in ids):
                    raise ValueError(f"{field}[{i}]: token ids must be ints in [0, {self.vocab_size})")
            else:
                ids = ref  # type: ignore[assignment]  # too long: refused below, never copied
            total += len(ids)
            if total > self.max_model_len:
                raise ValueError(f"{field}: over {self.max_model_len} tokens in all, the model's context")
            if ids:
                out.append(ids)
        return out

    def check_text_size(self, num_chars: int, field: str) -> None:
        """Refuse text that cannot fit the context whatever it tokenizes to, before tokenizing it."""
        limit = self.max_model_len * self.limits.max_prompt_chars_per_token
        if num_chars > limit:
            raise ValueError(f"{field}: {num_chars} characters cannot fit a context of {self.max_model_len} tokens")

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> TokenIds:
        """Token ids of chat messages (and the functions a model may call, OpenAI's `tools`)
        rendered with the model's chat template. Every bound is checked before the work it
        bounds: the message count and size (tool calls and schemas included) before templating,
        the rendered text's size before tokenizing. A template that mentions `tools` gets them
        and the tool messages as they are; any other gets them as text (`_as_text_chat`)."""
        if not messages:
            raise ValueError("input.chat: no messages")
        limit = min(self.limits.max_chat_messages, self.max_model_len)
        if len(messages) > limit:
            raise ValueError(f"input.chat: {len(messages)} messages, at most {limit}")
        self.check_text_size(_chat_chars(messages, tools), "input.chat")
        chat = [_checked_message(i, m) for i, m in enumerate(messages)]
        template = getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise ValueError("input.chat: the model has no chat template; send text or token_ids")
        source = template if isinstance(template, str) else " ".join(map(str, template.values()))
        native = "tools" in source  # the template renders tools, tool calls and results itself
        if not native:
            chat = _as_text_chat(chat, tools)
        try:
            text = self.tokenizer.apply_chat_template(
                chat, tools=list(tools) if native and tools else None, tokenize=False, add_generation_prompt=True
            )
        except Exception as e:  # the template's own checks (jinja raise_exception, bad fields)
            raise ValueError(f"input.chat: the model's chat template refused the messages: {e}") from None
        self.check_text_size(len(text), "input.chat (rendered)")
        return self._encode(text, False, "input.chat")

    def check_stop(self, stop: Sequence[str], stop_token_ids: Sequence[int] = ()) -> None:
        """Bound the stop strings (each one is searched for after every token) and stop ids."""
        limits = self.limits
        if len(stop) > limits.max_stop_sequences:
            raise ValueError(f"stop: {len(stop)} stop strings, at most {limits.max_stop_sequences}")
        for i, s in enumerate(stop):
            if len(s) > limits.max_stop_length:
                raise ValueError(f"stop[{i}]: {len(s)} characters, at most {limits.max_stop_length}")
        if len(stop_token_ids) > limits.max_stop_token_ids:
            raise ValueError(f"stop_token_ids: {len(stop_token_ids)} ids, at most {limits.max_stop_token_ids}")


# ---- chat messages with tools --------------------------------------------------------------


def format_tool_call(name: str, arguments: Any) -> str:
    """One call as the model writes it: a `<tool_call>` block around {"name", "arguments"}."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


def tools_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    """The system text that tells a model without a tools-aware template what it may call."""
    functions = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
    return TOOLS_PROMPT.format(functions=functions)


def _json_chars(value: Any, field: str) -> int:
    try:
        return len(json.dumps(value))
    except (TypeError, ValueError, RecursionError):
        raise ValueError(f"{field}: not JSON") from None


def _chat_chars(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None) -> int:
    """What messages and tools cost before templating: their text (tool calls' names and
    arguments, the tools' JSON) plus one character of markup per message and per call."""
    total = _json_chars(list(tools), "input.chat.tools") if tools else 0
    for m in messages:
        content = m.get("content")
        total += 1 + (len(content) if isinstance(content, str) else 0)
        calls = m.get("tool_calls")
        for call in calls if isinstance(calls, list) else ():
            total += 1 + _json_chars(call, "input.chat.tool_calls")
    return total


def _checked_message(i: int, m: Mapping[str, Any]) -> dict[str, Any]:
    """A message with its role resolved, its content text, and its tool calls checked, their
    arguments as a JSON object where they parse as one (what chat templates expect)."""
    field = f"input.chat.messages[{i}]"
    role = ROLE_ALIASES.get(m.get("role", ""), m.get("role"))
    if role not in CHAT_ROLES:
        raise ValueError(f"{field}.role must be system, developer, user, assistant or tool, got {m.get('role')!r}")
    content = m.get("content")
    if content is not None and not isinstance(content, str):
        raise ValueError(f"{field}.content must be text")
    out = {**m, "role": role, "content": content or ""}  # an assistant's calls may come without text
    calls = m.get("tool_calls")
    if calls is None:
        return out
    if role != "assistant" or not isinstance(calls, list):
        raise ValueError(f"{field}.tool_calls: only an assistant message has them, as a list")
    out["tool_calls"] = [_checked_call(f"{field}.tool_calls[{j}]", c) for j, c in enumerate(calls)]
    return out


def _checked_call(field: str, call: Any) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError(f"{field}.function.name must be a non-empty string")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except (ValueError, RecursionError):  # kept as the text the client sent (nested too deep to parse too)
            parsed = None
        args = parsed if isinstance(parsed, dict) else args
    elif not isinstance(args, Mapping):
        raise ValueError(f"{field}.function.arguments must be a JSON string or object")
    return {**call, "type": "function", "function": {**fn, "arguments": args}}


def _as_text_chat(chat: list[dict[str, Any]], tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]]:
    """Tools for a template that knows none: their list in the system message (merged into the
    first one, or a new one prepended), an assistant's calls as `<tool_call>` blocks after its
    text, and each run of tool results as one user message of `<tool_response>` blocks."""
    out: list[dict[str, Any]] = []
    after_result = False
    for m in chat:
        if m["role"] == "tool":
            block = f"{TOOL_RESPONSE_OPEN}\n{m['content']}\n{TOOL_RESPONSE_CLOSE}"
            if after_result:  # the results of parallel calls: one turn, as the calls were
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            after_result = True
            continue
        after_result = False
        if m.get("tool_calls"):
            calls = "\n".join(
                format_tool_call(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]
            )
            m = {"role": "assistant", "content": f"{m['content']}\n{calls}" if m["content"] else calls}
        out.append(m)
    if tools:
        prompt = tools_prompt(tools)
        if out[0]["role"] == "system":
            first = out[0]["content"]
            out[0] = {**out[0], "content": f"{first}\n\n{prompt}" if first else prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out

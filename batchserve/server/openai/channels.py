"""gpt-oss's answers in OpenAI's shape: its output is a run of harmony messages,

    <|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...<|return|>

(the prompt ends with `<|start|>assistant`, so the first message's header starts at once). The
`analysis` channel's text is the answer's `reasoning_content`, as other OpenAI-compatible servers
return it; `final` (and `commentary`, the model's preambles to the user) is its `content`. The
markup needs the special tokens' text, so such a call's output is detokenized with them
(`SamplingParams.skip_special_tokens`), and this splitter takes them out again."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")  # a message's end (the last two end the turn too)
MARKERS = (START, CHANNEL, MESSAGE, "<|constrain|>", *ENDS)
REASONING = "analysis"
# What a header may hold (role, channel, recipient, content type): more is not a header, and its
# text is shown as content rather than held without bound.
MOST_HEADER_CHARS = 256


def harmony_markup(tokenizer: Any) -> bool:
    """Whether the tokenizer's vocabulary speaks harmony (gpt-oss): its channel and message markers
    are tokens of their own."""
    convert = getattr(tokenizer, "convert_tokens_to_ids", None)
    if convert is None:
        return False
    unknown = getattr(tokenizer, "unk_token_id", None)
    ids = [convert(m) for m in (START, CHANNEL, MESSAGE)]
    return all(isinstance(i, int) and i >= 0 and i != unknown for i in ids)


@dataclass(slots=True)
class Split:
    """Text of the two kinds an answer holds."""

    reasoning: str = ""
    content: str = ""
    # Calls the model addressed to a function (`to=functions.NAME`): (name, arguments), each whole
    # at its message's end (or the answer's, where max_tokens cut it).
    calls: list[tuple[str, str]] = field(default_factory=list)


class ChannelSplit:
    """Splits one answer's text, fed as it is generated, into reasoning and content. A marker cut
    across two pieces is held back until it is whole; a header's text (role, channel, recipient)
    is never shown."""

    def __init__(self) -> None:
        self._pending = ""  # text not yet routed: a possible marker's start, or an open header
        self._in_header = True  # the prompt ended with `<|start|>assistant`: a header comes first
        self._header = ""
        self._channel: str | None = None  # the open message's; None between messages
        self._opened = False  # whether a message has opened (the model writes harmony)
        self._recipient: str | None = None  # the header's `to=` (a role's or a channel's part)
        self._call: str | None = None  # the open message's function, where it is a call
        self._arguments = ""

    def feed(self, text: str) -> Split:
        out = Split()
        self._pending += text
        while self._pending:
            at = self._pending.find("<|")
            plain, rest = (self._pending, "") if at < 0 else (self._pending[:at], self._pending[at:])
            if plain.endswith("<") and not rest:  # a marker's first character
                plain, rest = plain[:-1], "<"
            self._text(plain, out)
            marker = next((m for m in MARKERS if rest.startswith(m)), None)
            if marker is None:
                if any(m.startswith(rest) for m in MARKERS):  # cut short: wait for the rest
                    self._pending = rest
                    return out
                self._text(rest[:2], out)  # "<|" that begins no marker is text
                self._pending = rest[2:]
                continue
            self._marker(marker, out)
            self._pending = rest[len(marker) :]
        return out

    def flush(self) -> Split:
        """What is left once the answer ends: a cut marker's text, or a header that never opened a
        message (a model that wrote no harmony), as content."""
        out = self.feed("")
        if self._in_header:  # a header cut short is dropped, unless no message ever opened
            tail = "" if self._opened else self._header + self._pending
            self._send(tail, out, None)
        else:
            self._text(self._pending, out)
        self._pending, self._header = "", ""
        self._end_call(out)  # cut short by max_tokens: its arguments as far as they got
        return out

    def _text(self, text: str, out: Split) -> None:
        if not text:
            return
        if not self._in_header:
            if self._call is not None:
                self._arguments += text
            else:
                self._send(text, out, self._channel)
            return
        self._header += text
        if len(self._header) > MOST_HEADER_CHARS:  # no header: what it held is the answer's text
            self._in_header, self._channel, self._opened = False, None, True
            self._send(self._header, out, None)
            self._header = ""

    def _marker(self, marker: str, out: Split) -> None:
        if marker == START:
            self._in_header, self._header, self._channel, self._recipient = True, "", None, None
        elif marker == CHANNEL:
            self._scan()
            self._in_header, self._header = True, ""  # the channel's name comes next
        elif marker == MESSAGE:
            self._scan()
            words = [w for w in self._header.split() if not w.startswith("to=")]
            self._channel = words[0] if words else None
            recipient = self._recipient or ""
            self._call = recipient.removeprefix("functions.") if recipient.startswith("functions.") else None
            self._in_header, self._header, self._opened = False, "", True
        elif marker in ENDS:
            self._end_call(out)
            self._in_header, self._channel = False, None
        # `<|constrain|>` (a tool call's content type) stays inside the header

    def _scan(self) -> None:
        """The header's recipient so far (`to=...`: after the role or after the channel)."""
        for word in self._header.split():
            if word.startswith("to="):
                self._recipient = word[3:]

    def _end_call(self, out: Split) -> None:
        if self._call is not None:
            out.calls.append((self._call, self._arguments))
        self._call, self._arguments = None, ""

    @staticmethod
    def _send(text: str, out: Split, channel: str | None) -> None:
        if channel == REASONING:
            out.reasoning += text
        else:
            out.content += text


def split_channels(text: str) -> Split:
    """A whole answer's reasoning, content and calls."""
    split = ChannelSplit()
    return joined(split.feed(text), split.flush())


def joined(first: Split, then: Split) -> Split:
    return Split(first.reasoning + then.reasoning, first.content + then.content, first.calls + then.calls)

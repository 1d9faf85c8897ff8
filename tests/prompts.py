"""Prompts for the end-to-end checks: code and chat, 10 to ~600 tokens."""

from __future__ import annotations

import inspect
import json.decoder
import textwrap

CODE_PROMPTS = [
    'def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n',
    "from typing import List\n\n\ndef has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
    '    """Check if in given list of numbers, are any two numbers closer to each other than\n'
    "    given threshold.\n    >>> has_close_elements([1.0, 2.0, 3.0], 0.5)\n    False\n"
    '    >>> has_close_elements([1.0, 2.8, 3.0, 4.0, 5.0, 2.0], 0.3)\n    True\n    """\n',
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n",
    "-- Top 5 customers by total order value in 2023\nSELECT c.name, SUM(o.total) AS value\nFROM customers c\n",
    "function debounce(fn, wait) {\n  let timer = null;\n  return function (...args) {\n",
    "#include <stdio.h>\n\n/* Print the numbers 1 to n, one per line. */\nvoid print_numbers(int n) {\n",
    # Long code prompts taken from the standard library (stable for a given Python).
    inspect.getsource(textwrap)[:2400] + "\n\ndef count_lines(text):\n",
    inspect.getsource(json.decoder)[:1200] + "\n\ndef decode_all(strings):\n",
]

CHAT_PROMPTS = [
    "What is the capital of France?",
    "List the planets of the solar system in order, one per line.",
    "Write a haiku about the sea.",
    "Explain in two sentences what a hash map is.",
    "Translate 'good morning, how are you?' into Spanish and French.",
    "Give me three tips for writing clean Python code.",
    "Summarize the following text in one sentence.\n\n"
    + "The history of computing is longer than the history of computing hardware and modern computing "
    "technology and includes the history of methods intended for pen and paper or for chalk and slate, "
    "with or without the aid of tables. Digital computing is intimately tied to the representation of "
    "numbers. But long before abstractions like the number arose, there were mathematical concepts to "
    "serve the purposes of civilization. These concepts are implicit in concrete practices such as "
    "one-to-one correspondence, the basis of counting. " * 2,
    "Write a Python function that checks whether a string is a palindrome, then explain it.",
]


def chat(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    return list(tokenizer(rendered, add_special_tokens=False).input_ids)


def all_prompt_ids(tokenizer) -> list[list[int]]:
    code = [list(tokenizer(p).input_ids) for p in CODE_PROMPTS]
    return code + [chat(tokenizer, p) for p in CHAT_PROMPTS]

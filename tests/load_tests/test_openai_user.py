"""The HTTP Locust user's own verdict on a stream: `OpenAIUser._events` must report an error
event, a missing [DONE] or a broken connection as a failure (the SSE reader's judgement is
tested in test_sse.py; this checks the user acts on it). No server: a fake client hands the
user canned SSE lines. Importing locust monkey-patches the process (gevent), so the user runs
in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, sys
from types import SimpleNamespace
sys.path.insert(0, "load_tests")
import locustfile

class Response:
    def __init__(self, status, lines):
        self.status_code, self.lines, self.text = status, lines, "overloaded"
        self.request_meta, self.outcome = {}, None
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        return False
    def iter_lines(self):
        for line in self.lines:
            if line == "BREAK":
                raise ConnectionError("peer reset")
            yield line.encode()
    def failure(self, why):
        self.outcome = ["failure", str(why)]
    def success(self):
        self.outcome = ["success", None]

results = {}
for name, case in json.loads(sys.stdin.read()).items():
    resp = Response(case["status"], case["lines"])
    fired = []
    user = locustfile.OpenAIUser.__new__(locustfile.OpenAIUser)  # no environment, no session
    user.client = SimpleNamespace(post=lambda path, **kw: resp)
    request = SimpleNamespace(fire=lambda **kw: fired.append(kw["name"]))
    user.environment = SimpleNamespace(events=SimpleNamespace(request=request))
    user._events("/v1/completions", {}, case["stop_after"], "StreamGenerate")
    results[name] = {"outcome": resp.outcome, "length": resp.request_meta.get("response_length"), "fired": fired}
print(json.dumps(results))
"""

CHUNK = 'data: {"choices": [{"text": "a"}]}'
CASES = {
    "whole": {"status": 200, "lines": [CHUNK, "", CHUNK, "", "data: [DONE]", ""], "stop_after": None},
    "error-event": {
        "status": 200,
        "lines": [CHUNK, "", 'data: {"error": {"message": "engine error: boom"}}', "", "data: [DONE]", ""],
        "stop_after": None,
    },
    "no-done": {"status": 200, "lines": [CHUNK, "", CHUNK, ""], "stop_after": None},
    "broken": {"status": 200, "lines": [CHUNK, "", "BREAK"], "stop_after": None},
    "http-error": {"status": 503, "lines": [], "stop_after": None},
    "walk-away": {"status": 200, "lines": [CHUNK, "", CHUNK, "", CHUNK, ""], "stop_after": 1},
}


@pytest.fixture(scope="module")
def verdicts() -> dict[str, dict]:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        input=json.dumps(CASES),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_whole_stream_succeeds_with_its_chunks_and_ttft(verdicts):
    assert verdicts["whole"] == {"outcome": ["success", None], "length": 2, "fired": ["StreamGenerate TTFT"]}


@pytest.mark.parametrize(
    ("case", "why"),
    [("error-event", "boom"), ("no-done", "[DONE]"), ("broken", "stream broke"), ("http-error", "HTTP 503")],
)
def test_a_failed_stream_is_reported_as_a_failure(verdicts, case, why):
    outcome, message = verdicts[case]["outcome"]
    assert outcome == "failure" and why in message
    assert verdicts[case]["length"] is None  # never counted as a finished stream


def test_walking_away_on_purpose_is_a_success_without_ttft(verdicts):
    assert verdicts["walk-away"] == {"outcome": ["success", None], "length": 2, "fired": []}

from __future__ import annotations

import pytest

from batchserve.cli import main
from benchmarks.datasets import humaneval, sharegpt, split


def test_humaneval_has_all_problems_with_solutions():
    problems = humaneval()
    assert len(problems) == 164
    assert problems[0].id == "HumanEval/0" and "def " in problems[0].prompt and problems[0].reference.strip()
    dev, test = split(problems)
    assert len(dev) == len(test) == 82 and not {p.id for p in dev} & {p.id for p in test}


def test_sharegpt_reads_first_turns_record_by_record():
    samples = sharegpt(40)
    assert len(samples) == 40
    assert all(s.chat and s.prompt.strip() and s.reference.strip() for s in samples)
    assert len({s.id for s in samples}) == 40


def test_bench_simulate_cli(capsys):
    assert (
        main(
            [
                "bench",
                "--simulate",
                "--dataset",
                "humaneval",
                "--num-samples",
                "12",
                "--decoding-lengths",
                "4,16",
                "--no-speed",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "| trie hierarchical | " in out and "| llma (suffix copy) | " in out and "L=16" in out


@pytest.mark.parametrize("argv", [["bench"], ["bench", "--simulate", "--dataset", "imagenet"]])
def test_bench_cli_refuses_what_it_cannot_do(argv, capsys):
    assert main(argv) == 2
    assert "batchserve bench:" in capsys.readouterr().err


def test_bench_cli_rejects_malformed_numbers():
    with pytest.raises(SystemExit):
        main(["bench", "--simulate", "--decoding-lengths", "a,b"])

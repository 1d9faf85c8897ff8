"""One settings path: the config dataclasses are the LLM keywords, the CLI flags and the defaults."""

from __future__ import annotations

import dataclasses

import pytest

from batchserve.cli import build_parser, engine_config, main
from batchserve.config import (
    ADAPTIVE_DECODING_LENGTH,
    ATTENTION_BACKENDS,
    DRAFT_LAYOUTS,
    DRAFT_METHODS,
    FIXED_DECODING_LENGTH,
    SETTINGS,
    DraftConfig,
    EngineConfig,
    settings_of,
)
from batchserve.server.app import ServerConfig
from tests.conftest import make_tiny_model, make_tiny_tokenizer


def _serve_args(*flags: str):
    return build_parser().parse_args(["serve", *flags])


def test_every_setting_names_a_real_field_once():
    config = EngineConfig()
    assert len(SETTINGS) == len({(s.section, s.field) for s in SETTINGS.values()})
    for name, s in SETTINGS.items():
        section = getattr(config, s.section)
        assert s.field in {f.name for f in dataclasses.fields(section)}, name
        if name != "decoding_length":  # None until the policy resolves it
            assert s.default == getattr(type(section)(), s.field), name
    # The settings users reach for most, under the names LLM has always taken.
    for name in ("model", "draft", "draft_layout", "decoding_length", "adaptive", "max_num_seqs", "kv_cache_memory_gb"):
        assert name in SETTINGS


def test_the_cli_defaults_are_the_dataclass_defaults():
    # `batchserve serve` with no flags builds exactly the config LLM() and AsyncEngine() use.
    assert engine_config(_serve_args()) == EngineConfig()
    server = ServerConfig(**{s.field: getattr(_serve_args(), s.name) for s in settings_of(ServerConfig)})
    assert server == ServerConfig()


def test_flags_and_their_older_spellings_set_the_same_fields():
    new = engine_config(_serve_args("--max-num-seqs", "4", "--kv-cache-memory-gb", "0.5", "--profile-path", "p.json"))
    old = engine_config(_serve_args("--max-batch-size", "4", "--kv-cache-gb", "0.5", "--profile", "p.json"))
    assert new == old
    assert new.scheduler.max_num_seqs == 4 and new.cache.kv_cache_memory_gb == 0.5
    assert new.draft.profile_path == "p.json"
    assert EngineConfig().cache.prefix_caching
    assert not engine_config(_serve_args("--no-prefix-caching")).cache.prefix_caching
    args = _serve_args("--grace", "5", "--max-waiting", "7", "--no-reflection")
    assert (args.grace_seconds, args.max_waiting_requests, args.reflection) == (5.0, 7, False)


def test_choices_come_from_the_constants():
    actions = {a.dest: a for a in build_parser()._subparsers._group_actions[0].choices["serve"]._actions}
    assert tuple(actions["draft"].choices) == DRAFT_METHODS
    assert tuple(actions["draft_layout"].choices) == DRAFT_LAYOUTS
    assert tuple(actions["attention_backend"].choices) == ATTENTION_BACKENDS
    with pytest.raises(SystemExit):
        _serve_args("--draft", "magic")


def test_decoding_length_follows_the_policy_unless_set():
    assert DraftConfig().adaptive and DraftConfig().decoding_length == ADAPTIVE_DECODING_LENGTH
    assert DraftConfig(adaptive=False).decoding_length == FIXED_DECODING_LENGTH
    assert EngineConfig().with_settings(adaptive=False).draft.decoding_length == FIXED_DECODING_LENGTH
    assert engine_config(_serve_args("--no-adaptive")).draft.decoding_length == FIXED_DECODING_LENGTH
    # A length set on its own stays when the policy changes later.
    pinned = EngineConfig().with_settings(adaptive=False, decoding_length=8)
    assert pinned.with_settings(adaptive=True).draft.decoding_length == 8
    assert EngineConfig().with_settings(decoding_length=32).draft.decoding_length == 32


def test_unknown_or_invalid_settings_are_refused():
    with pytest.raises(TypeError, match=r"unknown setting.*max_batch"):
        EngineConfig().with_settings(max_batch=4)
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig().with_settings(max_num_seqs=0)
    with pytest.raises(TypeError, match="unknown setting"):
        from batchserve import LLM

        LLM(hf_model=make_tiny_model(), tokenizer=make_tiny_tokenizer(), speculate=True)


def test_a_removed_cpu_weights_choice_is_refused_saying_what_replaced_it(capsys):
    from batchserve.config import CPU_WEIGHTS, ModelConfig

    with pytest.raises(ValueError, match=r"cpu_weights=q4_1 is no longer a choice: .*read straight from the file with"
                       r" cpu_weights=gguf, which auto takes .*\('auto', 'gguf', 'float32', 'bfloat16'\)"):  # fmt: skip
        EngineConfig().with_settings(cpu_weights="q4_1")
    with pytest.raises(ValueError, match=r"cpu_weights must be one of \('auto', 'gguf', 'float32', 'bfloat16'\)"):
        ModelConfig(cpu_weights="q8")
    with pytest.raises(SystemExit):  # the CLI: argparse's own message, with every valid choice
        _serve_args("--cpu-weights", "q4_1")
    err = capsys.readouterr().err
    assert "invalid choice: 'q4_1'" in err and all(choice in err for choice in CPU_WEIGHTS)


def test_serve_refuses_a_bad_setting_before_loading_anything(capsys):
    assert main(["serve", "--max-num-seqs", "0"]) == 2
    assert "max_num_seqs must be >= 1" in capsys.readouterr().err


def test_llm_applies_keywords_over_a_given_config():
    from batchserve import LLM

    base = EngineConfig(draft=DraftConfig(method="llma", adaptive=False, decoding_length=4))
    llm = LLM(config=base, hf_model=make_tiny_model(), tokenizer=make_tiny_tokenizer(), max_num_seqs=3, num_blocks=32)
    config = llm.engine.config
    assert config.scheduler.max_num_seqs == 3 and config.cache.num_blocks == 32  # the keywords
    assert config.draft == base.draft  # and what the config said, kept
    assert llm.engine.scheduler.allocator.num_blocks == 32


def test_llm_and_the_server_share_their_defaults():
    # Adaptive drafting is on everywhere by default: LLM measures a cost profile (tests keep
    # it in a private directory) and plans with it.
    from batchserve import LLM

    llm = LLM(hf_model=make_tiny_model(), tokenizer=make_tiny_tokenizer())
    assert llm.engine.config == EngineConfig()
    assert llm.engine.cost_profile is not None and llm.engine.speculation.policy is not None

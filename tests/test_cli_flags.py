"""CLI conventions a vLLM user expects: ``serve MODEL``, sizes with units, help on every flag."""

from __future__ import annotations

import argparse

import pytest

from pagedllm.entrypoints.cli import build_parser
from pagedllm.config.args import EngineArgs
from pagedllm.config.args_help import parse_size


def subparsers() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_every_flag_has_help(command):
    missing = [a.option_strings or a.dest for a in subparsers()[command]._actions
               if not isinstance(a, argparse._HelpAction) and not a.help]
    assert missing == []


def test_serve_model_positional_and_sizes_with_units():
    args = build_parser().parse_args(["serve", "model.gguf", "--kv-cache-memory", "4GiB", "--swap-space", "512MB",
                                      "--chat-template", "t.jinja", "--tool-call-parser", "hermes"])
    assert args.model_tag == "model.gguf" and args.chat_template == "t.jinja" and args.tool_call_parser == "hermes"
    engine = EngineArgs.from_namespace(args)
    assert engine.kv_cache_memory == 4 << 30 and engine.swap_space == 512 * 10**6


@pytest.mark.parametrize("text, size", [("4GiB", 4 << 30), ("512mib", 512 << 20), ("1.5G", 1_500_000_000),
                                        ("2048", 2048), ("3 KB", 3000), ("1e6", 10**6)])
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["4 parsecs", "GiB", "-1GB", ""])
def test_parse_size_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError, match="invalid size"):
        parse_size(text)


def test_bad_size_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-cache-memory", "lots"])
    assert "invalid size 'lots'" in capsys.readouterr().err


@pytest.mark.parametrize("kw, field", [
    ({"num_blocks": 0}, "num_blocks"), ({"num_blocks": -3}, "num_blocks"), ({"kv_cache_memory": -1}, "kv_cache_memory"),
    ({"kv_cache_fraction": 2.0}, "kv_cache_fraction"), ({"swap_space": -1}, "swap_space"),
    ({"max_model_len": 0}, "max_model_len"), ({"max_model_len": -5}, "max_model_len"),
    ({"kv_disk_size": -1}, "kv_disk_size"), ({"seed": "x"}, "seed"), ({"seed": None}, "seed")])
def test_bad_engine_sizes_are_refused_naming_the_field(kw, field):
    """Each was accepted (swap_space -1, max_model_len 0, kv_disk_size -1 without a disk path), failed later naming
    another field (num_blocks 0: "raise --kv-cache-memory") or none (seed "x": "invalid literal for int()"), or
    failed inside torch (max_model_len -5: "Dimension size must be non-negative")."""
    with pytest.raises(ValueError, match=f"^{field} must be"):
        EngineArgs(**kw)

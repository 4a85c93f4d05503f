"""`vllm serve` command lines on `pagedllm serve`: a corpus of real lines (tests/server/data) parses with vLLM's
meaning or is refused saying why, before anything starts."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm.config.args import EngineArgs
from pagedllm.entrypoints.cli import build_parser, main, prepare

LINES = json.loads((Path(__file__).parent / "data" / "vllm_serve_lines.json").read_text())["lines"]


def serve_argv(line: str) -> list[str]:
    argv = shlex.split(line)
    assert argv[:2] == ["vllm", "serve"], line
    return argv[1:]


def parse(line: str):
    return prepare(build_parser().parse_args(serve_argv(line)))


@pytest.mark.parametrize("case", LINES, ids=[f"{i}:{c['source'][:40]}" for i, c in enumerate(LINES)])
def test_real_vllm_serve_lines(case, capsys):
    if case["expect"] == "ok":
        args = parse(case["line"])
        engine = EngineArgs.from_namespace(args)
        argv = serve_argv(case["line"])
        named = argv[argv.index("--model") + 1] if "--model" in argv else argv[1]
        assert engine.model == named
        return
    try:  # refused: a usage error (exit 2) or main's one-line error, never a traceback
        rc = main(serve_argv(case["line"]))
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and case["expect"] in err, err
    assert "Traceback" not in err


def test_vllm_units_and_names_map_onto_ours():
    corpus = {c["source"]: c["line"] for c in LINES}
    amd = EngineArgs.from_namespace(parse(corpus["vLLM command templates (AMD Llama-3.1-70B FP8-KV)"]))
    assert amd.kv_cache_dtype == "fp8_e4m3" and amd.max_num_batched_tokens == 65536 and amd.max_num_seqs == 1024
    assert EngineArgs.from_namespace(parse(corpus["vLLM benchmarks README"])).swap_space == 16 << 30
    assert EngineArgs.from_namespace(parse("vllm serve m --swap-space 1.5")).swap_space == 3 << 29
    assert EngineArgs.from_namespace(parse("vllm serve m --swap-space 512MB")).swap_space == 512 * 10**6
    assert EngineArgs.from_namespace(parse("vllm serve m --dtype float --device cpu")).dtype == "float32"


def test_logging_flags_work_after_serve():
    args = parse("vllm serve m --disable-log-stats --log-level debug --enable-log-requests")
    assert args.log_level == "debug" and args.uvicorn_log_level == "debug" and args.stats_interval == 0
    assert args.enable_log_requests
    args = parse("vllm serve m --uvicorn-log-level warning")
    assert args.log_level == "info" and args.uvicorn_log_level == "warning" and args.stats_interval == 10.0
    assert prepare(build_parser().parse_args(["--log-level", "error", "serve", "m"])).log_level == "error"


@pytest.mark.parametrize("line, why", [
    ("vllm serve m --enable-auto-tool-choice", "needs --tool-call-parser"),
    ("vllm serve m --tokenizer other", "the tokenizer is always the model's own"),
    ("vllm serve m --response-role bot", "role 'assistant'"),
    ("vllm serve m --max-logprobs 50", "[0, 20]"),
    ("vllm serve m --generation-config ./gen", "only 'vllm' or 'auto'"),
    ("vllm serve m --revision main", "hub revision"),
    ("vllm serve m --hf-overrides {}", "overriding the model's config"),
    ("vllm serve m --structured-outputs-config '{\"backend\": \"guidance\"}'", "xgrammar"),
    ("vllm serve m --disable-fastapi-docs --enable-docs", "conflicts"),
    ("vllm serve m --data-parallel-size 2 --kv-events-config "
     "'{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\"}'", "one event endpoint per replica"),
    ("vllm serve m --kv-events-config '{\"publisher\": \"kafka\"}'", "publisher must be"),
])
def test_flags_we_cannot_honour_are_refused_saying_why(line, why):
    with pytest.raises(ValueError, match=why.replace("[", r"\[").replace("]", r"\]")):
        parse(line)


def test_generation_config_auto_is_refused_when_the_model_has_sampling_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "eos_token_id": 2}))
    with pytest.raises(ValueError, match="sets temperature"):
        parse(f"vllm serve {tmp_path}")
    assert parse(f"vllm serve {tmp_path} --generation-config vllm").generation_config == "vllm"


def test_failed_core_start_exits_cleanly():
    """A core that fails to start raises once; nothing fails again at exit (the reader never started)."""
    code = ("from pagedllm.config.args import EngineArgs\nfrom pagedllm.frontend.async_engine import AsyncEngine\n"
            "try:\n    AsyncEngine(EngineArgs(dtype='bogus'))\nexcept RuntimeError as e:\n"
            "    print('failed:', 'unknown dtype' in str(e))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "failed: True", r.stderr
    assert "atexit" not in r.stderr and "AttributeError" not in r.stderr, r.stderr


@pytest.mark.slow
def test_allowed_origins_turn_on_cors_and_return_tokens_as_ids_is_the_default():
    import httpx
    from tests.server.conftest import live_server

    args = parse("vllm serve m --allowed-origins '[\"http://app.example\"]' --return-tokens-as-token-ids")
    with live_server(allowed_origins=args.allowed_origins,
                     return_tokens_as_token_ids=args.return_tokens_as_token_ids) as srv:
        pre = httpx.options(f"{srv.url}/v1/completions", headers={
            "Origin": "http://app.example", "Access-Control-Request-Method": "POST"})
        assert pre.headers["access-control-allow-origin"] == "http://app.example"
        other = httpx.options(f"{srv.url}/v1/completions", headers={
            "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
        assert "access-control-allow-origin" not in other.headers
        r = httpx.post(f"{srv.url}/v1/completions", headers={"Authorization": f"Bearer {srv.api_key}"}, timeout=120,
                       json={"prompt": "Hi", "max_tokens": 2, "logprobs": 1}).json()
        assert all(t.startswith("token_id:") for t in r["choices"][0]["logprobs"]["tokens"])

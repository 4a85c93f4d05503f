"""``pagedllm``: generate / chat / serve / bench. With no flags every command runs the embedded model."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from pagedllm.config.args import EngineArgs
from pagedllm.entrypoints.vllm_flags import (
    add_vllm_serve_flags, apply_vllm_serve_flags, log_vllm_serve_notes, resolve_cli_dtypes,
)

TOOL_CALL_PARSERS = ["hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder"]  # server/tool_parsers.py


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help="most tokens to generate per reply")
    g.add_argument("--temperature", type=float, default=0.7, help="0 for greedy")
    g.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling: smallest set with this mass")
    g.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: off)")
    g.add_argument("--repetition-penalty", type=float, default=1.1, help="divide repeated tokens' logits (1: off)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _sampling_params(args: argparse.Namespace):
    from pagedllm.protocol.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, repetition_penalty=args.repetition_penalty, stop=args.stop)


def _engine(args: argparse.Namespace):
    from pagedllm.frontend.llm_engine import LLMEngine

    return LLMEngine(EngineArgs.from_namespace(args))


def _stream(eng, prompt: str | list[int], params) -> str:
    """Step the engine until the request finishes, printing its text as it settles; returns the text.

    Ctrl-C aborts the request (freeing its blocks) before propagating.
    """
    from pagedllm.server.protocol import DeltaTracker

    rid = eng.add_request(prompt, params)
    tracker = DeltaTracker(params.stop)
    try:
        while True:
            for res in eng.step():
                if res.request_id != rid:
                    continue
                out = res.outputs[0]
                delta = tracker.advance(out)
                if delta is not None:
                    print(delta.text, end="", flush=True)
                if res.finished:
                    print(flush=True)
                    return out.text
    except KeyboardInterrupt:
        eng.abort_request(rid)
        print(flush=True)
        raise


def cmd_generate(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.llm import apply_chat_template

    eng = _engine(args)
    prompt = apply_chat_template(eng.tokenizer, [{"role": "user", "content": args.prompt}]) if args.chat \
        else args.prompt
    _stream(eng, prompt, _sampling_params(args))
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.llm import apply_chat_template

    eng = _engine(args)
    params = _sampling_params(args)
    history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    print(f"chatting with {eng.model_name}; /reset clears the history, /exit or Ctrl-D quits", file=sys.stderr)
    while True:
        try:
            line = input(">>> ").strip()
        except EOFError:
            print()
            return 0
        if line == "/exit":
            return 0
        if line == "/reset":
            del history[1 if args.system else 0:]
            continue
        if not line:
            continue
        turn = history + [{"role": "user", "content": line}]
        try:
            reply = _stream(eng, apply_chat_template(eng.tokenizer, turn), params)
        except ValueError as e:  # e.g. the history outgrew the context: say so, keep chatting
            print(f"error: {e} (/reset clears the history)", file=sys.stderr)
            continue
        except KeyboardInterrupt:
            continue  # the reply was aborted; the question is dropped from the history
        history = turn + [{"role": "assistant", "content": reply}]


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from pagedllm.frontend.async_engine import AsyncEngine
    from pagedllm.server import create_app
    from pagedllm.server.guards import default_allowed_hosts
    from pagedllm.server.tenants import load_api_keys

    chat_template = args.chat_template
    if chat_template is not None and os.path.isfile(chat_template):
        with open(chat_template, encoding="utf-8") as f:
            chat_template = f.read()
    allowed_hosts = args.allowed_hosts.split(",") if args.allowed_hosts else default_allowed_hosts(args.host)
    from pagedllm.scaleout.config import wants_scaleout

    eargs = EngineArgs.from_namespace(args)
    if wants_scaleout(eargs):  # replicas on Ray (the ray extra)
        from pagedllm.scaleout.engine import ScaleOutEngine

        engine = ScaleOutEngine(eargs)
    else:
        engine = AsyncEngine(eargs)
    app = create_app(engine, api_key=args.api_key, served_model_name=args.served_model_name,
                     stats_interval_s=args.stats_interval or None, metrics_token=args.metrics_token,
                     metrics_open=args.metrics_open, enable_docs=args.enable_docs, allowed_hosts=allowed_hosts,
                     allow_unknown_fields=args.allow_unknown_fields, tool_call_parser=args.tool_call_parser,
                     chat_template=chat_template, restart_core=not args.no_restart_core,
                     api_keys=load_api_keys(args.api_keys_file) if args.api_keys_file else None,
                     on_core_lost=lambda: os.kill(os.getpid(), signal.SIGTERM),  # uvicorn stops gracefully
                     allowed_origins=args.allowed_origins,
                     return_tokens_as_token_ids=args.return_tokens_as_token_ids, max_logprobs=args.max_logprobs,
                     log_requests=args.enable_log_requests, reasoning_parser=args.reasoning_parser)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level, root_path=args.root_path,
                    ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile)
    finally:
        engine.shutdown()
    return 1 if app.state.supervisor.gave_up else 0


def cmd_bench(args: argparse.Namespace) -> int:
    try:
        from pagedllm.bench.cli import main as bench_main
    except ModuleNotFoundError as e:
        if e.name != "pagedllm.bench.cli":
            raise
        print("pagedllm bench: the benchmark suite (pagedllm.bench.cli) is not installed in this build",
              file=sys.stderr)
        return 2
    return bench_main(args.args) or 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description="LLM inference and serving built on PagedAttention.")
    parser.add_argument("--log-level", default=None, choices=["debug", "info", "warning", "error"],
                        help="default: info for serve, warning otherwise")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{generate,chat,serve,bench}")

    p = sub.add_parser("generate", help="generate once from a prompt, streaming to the terminal")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="wrap the prompt in the model's chat template as a user turn")
    _add_sampling_args(p, max_tokens=64)
    EngineArgs.add_cli_args(p.add_argument_group("engine"))
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive chat with history")
    p.add_argument("--system", default=None, help="system prompt")
    _add_sampling_args(p, max_tokens=256)
    EngineArgs.add_cli_args(p.add_argument_group("engine"))
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="GGUF file or HF directory to serve (same as --model; default: the embedded model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--api-key", default=os.environ.get("PAGEDLLM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route that shows data, /metrics and the KV "
                        "snapshot included; /health, /ping, /version stay open (default: $PAGEDLLM_API_KEY)")
    p.add_argument("--api-keys-file", default=None,
                   help="a file of 'KEY TENANT' lines: each key is accepted as --api-key is, and each tenant's "
                        "prefix cache is salted apart (no tenant hits, or can time, another's cached prompts)")
    p.add_argument("--metrics-token", default=os.environ.get("PAGEDLLM_METRICS_TOKEN"),
                   help="a second bearer token accepted on /metrics only, for a scraper (default: "
                        "$PAGEDLLM_METRICS_TOKEN)")
    p.add_argument("--metrics-open", action="store_true", help="leave /metrics open even with --api-key")
    p.add_argument("--enable-docs", action="store_true", help="serve /docs, /redoc and /openapi.json")
    p.add_argument("--allowed-hosts", default=None,
                   help="comma-separated Host header names accepted ('*': any; IP literals always are); default: "
                        "no check on loopback, the machine's names beyond it")
    p.add_argument("--served-model-name", default=None, help="model name clients send (default: the model's)")
    p.add_argument("--chat-template", default=None,
                   help="Jinja chat template (a file or the template text) replacing the model's, e.g. "
                        "pagedllm/server/chat_templates/hermes_tools.jinja to offer tools")
    p.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                   help="parse tool calls out of outputs (needed for tool_choice 'auto'): hermes (<tool_call> JSON), "
                        "llama3_json, mistral ([TOOL_CALLS]), pythonic ([f(a=1)]), qwen3_coder (<function=...> XML); "
                        "templates that render tools for each are in pagedllm/server/chat_templates/")
    p.add_argument("--allow-unknown-fields", action="store_true",
                   help="log a warning for unknown request fields instead of answering 400")
    p.add_argument("--no-restart-core", action="store_true",
                   help="when the engine core process dies, exit non-zero (for an orchestrator that restarts pods) "
                        "instead of restarting it (with backoff, at most 5 tries)")
    p.add_argument("--stats-interval", type=float, default=10.0,
                   help="seconds between stats lines in the log (0: none)")
    EngineArgs.add_cli_args(p.add_argument_group("engine"))
    add_vllm_serve_flags(p)
    p.set_defaults(func=cmd_serve)

    # no option prefix: every word after "bench", --help included, belongs to the benchmark CLI
    p = sub.add_parser("bench", help="benchmarks (pagedllm bench <name> --help)", add_help=False, prefix_chars="\0")
    p.add_argument("args", nargs=argparse.REMAINDER, help="benchmark name and its arguments")
    p.set_defaults(func=cmd_bench)
    return parser


def _model_tag(args: argparse.Namespace) -> None:
    """vLLM's ``serve MODEL``: the positional model is ``--model``."""
    tag = getattr(args, "model_tag", None)
    if tag is not None:
        if args.model is not None and args.model != tag:
            raise ValueError(f"model given twice: {tag!r} and --model {args.model!r}")
        args.model = tag


def _is_worker_rank(args: argparse.Namespace) -> bool:
    """Under torchrun with ``--distributed-executor-backend external_launcher``, ranks other than 0 run no
    command of their own (no server): they execute rank 0's engine steps."""
    return (getattr(args, "distributed_executor_backend", None) == "external_launcher"
            and os.environ.get("RANK", "0") != "0")


def prepare(args: argparse.Namespace) -> argparse.Namespace:
    """The parsed command line made whole: the positional model, vLLM's dtype names and serve flags; ValueError
    (saying why) for settings that cannot run, before anything starts."""
    args.log_level = args.log_level or ("info" if args.command == "serve" else "warning")  # also after serve
    _model_tag(args)
    if hasattr(args, "dtype"):
        resolve_cli_dtypes(args)
    if args.command == "serve":
        apply_vllm_serve_flags(args)
    return args


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        prepare(args)
        logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        log_vllm_serve_notes(args)
        if _is_worker_rank(args):
            from pagedllm.executor.external_launcher import serve_rank

            serve_rank(EngineArgs.from_namespace(args))
            return 0
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except ValueError as e:  # bad settings or prompt, as the engine words it (logging may not be set up yet)
        print(f"pagedllm: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

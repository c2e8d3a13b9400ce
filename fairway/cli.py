"""`fairway serve | gateway | replica | generate | chat`: the command line."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import uuid

from fairway.models.bundled import ModelFileError


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a .gguf file or Hugging Face folder (default: bundled SmolLM2)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")


def _build(args: argparse.Namespace):
    from fairway.engine.factory import build_engine

    return build_engine(args.model, args.dtype, args.device)


def cmd_generate(args: argparse.Namespace) -> int:
    from fairway.engine import SamplingParams

    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    engine = _build(args)
    tok = engine.tokenizer
    if args.chat:
        prompt = tok.chat_prompt_ids([{"role": "user", "content": args.prompt}])
    else:
        prompt = tok.encode(args.prompt)
    engine.add_request(uuid.uuid4().hex, prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from fairway.engine import SamplingParams

    engine = _build(args)
    tok = engine.tokenizer
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("Fairway chat with the bundled model. Empty line or Ctrl-D quits.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
        engine.add_request(uuid.uuid4().hex, tok.chat_prompt_ids(messages), params)
        reply = []
        while engine.has_unfinished():
            for out in engine.step():
                reply.append(out.text)
                sys.stdout.write(out.text)
                sys.stdout.flush()
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})
    return 0


def _stack_options(args: argparse.Namespace):
    from fairway.stack import StackOptions

    return StackOptions(
        model=getattr(args, "model", None),
        dtype=getattr(args, "dtype", "bfloat16"),
        device=getattr(args, "device", "cpu"),
        redis=getattr(args, "redis", None),
        database=getattr(args, "database", None),
        namespace=args.namespace,
        log_ttl_s=args.log_ttl,
        idle_cancel_s=getattr(args, "idle_cancel", 30.0),
        max_model_len=getattr(args, "max_model_len", None),
        replica_id=getattr(args, "replica_id", None),
        default_max_tokens=getattr(args, "default_max_tokens", 512),
    )


def _serve_app(app, args: argparse.Namespace) -> int:
    import uvicorn

    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from fairway.stack import embedded_app

    options = _stack_options(args)
    print(f"Fairway: loading {options.model or 'the bundled model'} ...", file=sys.stderr)
    app = embedded_app(options)
    print(f"Fairway: OpenAI-compatible API on http://{args.host}:{args.port}/v1", file=sys.stderr)
    return _serve_app(app, args)


def cmd_gateway(args: argparse.Namespace) -> int:
    from fairway.stack import gateway_app

    return _serve_app(gateway_app(_stack_options(args)), args)


def cmd_replica(args: argparse.Namespace) -> int:
    from fairway.stack import run_replica

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")

    async def main() -> None:
        # SIGTERM (the supervisor, Kubernetes) ends it like Ctrl-C: replies in flight get their
        # final event and the replica leaves routing at once instead of timing out.
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await run_replica(_stack_options(args))

    asyncio.run(main())
    return 0


def _http_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def _relay_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--namespace", default="fairway:", help="Redis key prefix (separate deployments on one Redis)")
    p.add_argument("--log-ttl", type=float, default=1800.0, help="seconds a reply's token log is kept after its last event")


def _generation_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--idle-cancel", type=float, default=30.0, help="cancel a reply nobody listened to for this many seconds")
    p.add_argument("--max-model-len", type=int, default=None, help="cap the context window (tokens)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fairway", description="Fairway LLM serving stack")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt; prints only the generated text")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--chat", action="store_true", help="wrap the prompt as one user message in the chat template")
    _engine_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="a terminal chat with the model; the conversation is kept across turns")
    c.add_argument("--max-tokens", type=int, default=256)
    c.add_argument("--temperature", type=float, default=0.7)
    c.add_argument("--seed", type=int, default=None)
    c.add_argument("--system", default=None, help="a system message for the conversation")
    _engine_args(c)
    c.set_defaults(func=cmd_chat)

    s = sub.add_parser("serve", help="the OpenAI-compatible API with the model, all in one process (no other servers)")
    _http_args(s)
    _engine_args(s)
    _relay_args(s)
    _generation_args(s)
    s.add_argument("--database", default=os.environ.get("FAIRWAY_DATABASE_URL"),
                   help="conversation store URL (default: SQLite in ./.fairway/)")
    s.add_argument("--default-max-tokens", type=int, default=512)
    s.set_defaults(func=cmd_serve)

    gw = sub.add_parser("gateway", help="a stateless API gateway sharing Redis and a database with replicas")
    _http_args(gw)
    _relay_args(gw)
    gw.add_argument("--redis", required=not os.environ.get("FAIRWAY_REDIS_URL"),
                    default=os.environ.get("FAIRWAY_REDIS_URL"), help="redis://host:port/db")
    gw.add_argument("--database", required=not os.environ.get("FAIRWAY_DATABASE_URL"),
                    default=os.environ.get("FAIRWAY_DATABASE_URL"), help="postgresql://user@host/db (or sqlite://)")
    gw.add_argument("--model", default=None, help="the model whose tokenizer builds prompts (default: bundled)")
    gw.add_argument("--default-max-tokens", type=int, default=512)
    gw.set_defaults(func=cmd_gateway)

    r = sub.add_parser("replica", help="an engine process: claims replies from Redis, writes their tokens back")
    _engine_args(r)
    _relay_args(r)
    _generation_args(r)
    r.add_argument("--redis", required=not os.environ.get("FAIRWAY_REDIS_URL"),
                   default=os.environ.get("FAIRWAY_REDIS_URL"), help="redis://host:port/db")
    r.add_argument("--replica-id", default=None)
    r.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    r.set_defaults(func=cmd_replica)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ModelFileError as exc:
        print(f"fairway: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # bad sampling parameters and the like: one line, no traceback
        print(f"fairway: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

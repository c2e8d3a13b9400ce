"""`fairway generate | chat | ...`: the command line."""

from __future__ import annotations

import argparse
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

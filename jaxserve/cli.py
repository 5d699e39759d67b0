"""`jaxserve` command line: generate | train-tiny."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_MODEL = Path(__file__).resolve().parent / "assets" / "tiny-adder"


def _generate(args: argparse.Namespace) -> int:
    from jaxserve.models import loader, reference_generate
    from jaxserve.tokenizer import Tokenizer

    model = loader.load_model(args.model, dtype=args.dtype)
    tokenizer = Tokenizer.from_dir(args.model)
    prompts = [tokenizer.encode(p) for p in args.prompt]
    result = reference_generate.greedy_generate(
        model.params, model.config, prompts, args.max_tokens, eos_token_ids=model.generation.eos_token_ids,
        keep_logits=False,
    )
    for prompt, tokens in zip(args.prompt, result.tokens):
        print(f"{prompt!r} -> {tokenizer.decode(tokens)!r}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxserve", description="LLM inference engine in JAX")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="greedy generation from prompts")
    gen.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="local HF checkpoint directory")
    gen.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=16)
    gen.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"])
    sub.add_parser("train-tiny", help="train the embedded default model", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "train-tiny":
        from jaxserve import train_tiny

        train_tiny.main(rest)
        return 0
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return _generate(args)


if __name__ == "__main__":
    sys.exit(main())

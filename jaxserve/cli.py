"""`jaxserve` command line: generate | serve | bench | router.

    jaxserve generate [--config configs/tiny.yaml] [--model DIR] (--prompt TEXT ... | --prompts-file F.jsonl)
                      [--output F.jsonl] [sampling flags] [engine flags: --max-num-seqs 8,
                      --tensor-parallel-size 2, ... as `jaxserve serve`'s; `--seed` is the sampling seed,
                      `--model-seed` the engine's]

A prompts file holds one JSON object per line: {"prompt": "..."} or {"prompt_token_ids": [...]}, optionally
with "cache_salt" (only requests with the same salt share prefix-cache blocks).
Results are printed, or written as JSON lines (one per prompt, in input order) with --output; with
--logprobs N each output also carries its cumulative_logprob and, per generated token, the top-N
{token id: {logprob, rank, decoded_token}} (vLLM's CompletionOutput.logprobs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from jaxserve import config_flags
from jaxserve.config import DEFAULT_CONFIG

SAMPLING_FLAGS = {  # flag -> (type, SamplingParams field)
    "--temperature": float, "--top-p": float, "--top-k": int, "--min-p": float, "--max-tokens": int,
    "--min-tokens": int, "--seed": int, "--n": int, "--repetition-penalty": float, "--presence-penalty": float,
    "--frequency-penalty": float, "--logprobs": int,
}


def _read_prompts(args: argparse.Namespace) -> list:
    if args.prompts_file is None:
        return list(args.prompt)
    from jaxserve.bench.prompts import prompt_objects  # (numpy: loaded only when a file is read)
    from jaxserve.input_processor import PROMPT_KEYS  # (the tokenizer's modules, likewise)

    prompts = []
    for where, item in prompt_objects(args.prompts_file, "--prompts-file", bare_strings=True):
        unknown = set(item) - set(PROMPT_KEYS)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; known: {list(PROMPT_KEYS)}")
        prompts.append(item)
    return prompts


def _check_output_path(output: Path) -> None:
    """Refuse an --output that cannot be written before any work (the engine takes a while to build)."""
    if output.is_dir():
        raise ValueError(f"--output {output} is a directory; give a file path, e.g. {output / 'results.jsonl'}")
    if not output.parent.is_dir():
        raise ValueError(f"--output {output}: directory {output.parent} does not exist; create it first")
    if not os.access(output.parent, os.W_OK) or (output.exists() and not os.access(output, os.W_OK)):
        raise ValueError(f"--output {output} is not writable; choose another path")


def _result(out) -> dict:
    """One --output line: vLLM's RequestOutput fields, logprobs only when they were requested."""
    outputs = []
    for c in out.outputs:
        item = {"index": c.index, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason}
        if c.logprobs is not None:
            item["cumulative_logprob"] = c.cumulative_logprob
            item["logprobs"] = [{str(token): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                                 for token, lp in position.items()} for position in c.logprobs]
        outputs.append(item)
    return {"prompt": out.prompt, "prompt_token_ids": out.prompt_token_ids,
            "num_cached_tokens": out.num_cached_tokens, "outputs": outputs}


def _generate(args: argparse.Namespace, engine_flags: list[config_flags.ConfigFlag]) -> int:
    if args.output:
        _check_output_path(args.output)
    from jaxserve import LLM, SamplingParams, load_config

    overrides = config_flags.overrides(vars(args), engine_flags)
    config = load_config(args.config or (DEFAULT_CONFIG if DEFAULT_CONFIG.exists() else None), **overrides)
    if config.parallel.num_processes > 1 and config.parallel.process_id != 0:
        from jaxserve.distributed import run_follower

        run_follower(config)  # process 0 generates; this one follows its steps
        return 0
    params = {flag[2:].replace("-", "_"): getattr(args, flag[2:].replace("-", "_"))
              for flag in SAMPLING_FLAGS if getattr(args, flag[2:].replace("-", "_")) is not None}
    if args.stop:
        params["stop"] = args.stop
    if args.ignore_eos:
        params["ignore_eos"] = True
    sampling = SamplingParams(**params)
    prompts = _read_prompts(args)
    llm = LLM(config=config, progress=not args.quiet)
    outputs = llm.generate(prompts, sampling, use_tqdm=not args.quiet)
    llm.close()
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            for out in outputs:
                f.write(json.dumps(_result(out)) + "\n")
    else:
        for out in outputs:
            shown = out.prompt if out.prompt is not None else out.prompt_token_ids
            for c in out.outputs:
                print(f"{shown!r} -> {c.text!r}  ({c.finish_reason})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxserve", description="LLM inference engine in JAX")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="offline batch generation")
    gen.add_argument("--config", type=Path, help=f"engine config YAML (default: {DEFAULT_CONFIG.name})")
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    source.add_argument("--prompts-file", type=Path, help="JSON lines with 'prompt' or 'prompt_token_ids'")
    gen.add_argument("--output", type=Path, help="write results as JSON lines here")
    gen.add_argument("--stop", action="append", help="a stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--quiet", action="store_true", help="no progress bars")
    for flag, kind in SAMPLING_FLAGS.items():
        gen.add_argument(flag, type=kind)
    own = {"--config", "--prompt", "--prompts-file", "--output", "--stop", "--ignore-eos", "--quiet", *SAMPLING_FLAGS}
    engine_flags = config_flags.add_config_flags(gen, reserved=own, skip_sections={"server"})
    sub.add_parser("serve", help="OpenAI-compatible server (jaxserve serve --help)", add_help=False)
    sub.add_parser("bench", help="benchmarks: throughput | latency | serve", add_help=False)
    sub.add_parser("router", help="one OpenAI endpoint over prefill/decode instances (jaxserve router --help)",
                   add_help=False)
    sub.add_parser("train-tiny", help="(a source-checkout tool: python tools/train_tiny.py)", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "train-tiny":
        print("error: training the embedded model is a tool of the source checkout, not of the engine: "
              "pip install -e '.[train]', then python tools/train_tiny.py --help", file=sys.stderr)
        return 2
    if args.command == "serve":
        from jaxserve.server import cli as server_cli

        return server_cli.main(rest)
    if args.command == "router":
        from jaxserve.pd import router

        return router.main(rest)
    if args.command == "bench":
        from jaxserve import bench

        return bench.main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return _generate(args, engine_flags)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

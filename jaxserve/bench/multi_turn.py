"""`jaxserve bench multi-turn`: multi-turn chat offline, the workload of the KV cache tiers.

    --num-conversations C conversations of --num-turns T turns. Turn 1 of a conversation is --first-len
    random token ids; turn t + 1 is turn t's prompt, its answer (--output-len tokens) and --append-len new
    random ids (the next user message). Every conversation's turn t is queued at once, then every turn t + 1
    (the rounds of C users who all answer before anyone speaks again), so by its next turn a conversation's
    history may have left the device pool: with a host or disk tier (cache.host_kv_gib, cache.disk_kv_path)
    it comes back from there, without one it is recomputed.
    -> TTFT of the first turns and of the returning turns (t >= 2), total tokens/s over every turn (prompt
       and output tokens, each history counted at each turn), the returning turns' prefix hit rate and the
       per-tier hits, and the KV cache report (hits, bytes moved, evictions, loads per tier).

The working set is C x the last turn's length; set the device pool with --num-blocks (cache.num_blocks) to
make it a multiple of the pool.

    jaxserve bench multi-turn --config configs/llama3-8b-dummy.yaml --num-conversations 64 --num-turns 3 \\
        --first-len 1024 --append-len 128 --output-len 128 --host-kv-gib 64 --output-json mt.json
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from jaxserve.bench import common, spec


def _hits(engine) -> tuple[int, int, int, int]:
    kv = engine.stats().kv_cache
    return (0, 0, 0, 0) if kv is None else (kv.queries, kv.hits, kv.host_hits, kv.disk_hits)


def run(args: argparse.Namespace) -> dict[str, Any]:
    for name in ("num_conversations", "num_turns", "first_len", "output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.append_len < 0:
        raise ValueError(f"--append-len must be >= 0, got {args.append_len}")
    config = common.engine_config(args)
    last_len = args.first_len + (args.num_turns - 1) * (args.output_len + args.append_len)
    engine, init_s = common.make_engine(config, progress=not args.disable_tqdm)
    if last_len + args.output_len > engine.max_model_len:
        engine.close()
        raise ValueError(f"the last turn needs {last_len + args.output_len} tokens, more than "
                         f"max_model_len={engine.max_model_len}; lower --num-turns or the lengths")
    tokenizer = engine.tokenizer
    vocab_size = engine.vocab_size if tokenizer is None else min(len(tokenizer), engine.vocab_size)
    special = () if tokenizer is None else tokenizer.all_special_ids
    rng = np.random.default_rng(args.seed)
    allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(list(special), np.int64))

    def draw(count: int) -> list[int]:
        return rng.choice(allowed, count).tolist()

    histories = [draw(args.first_len) for _ in range(args.num_conversations)]
    turns, elapsed, tokens = [], 0.0, 0
    for turn in range(args.num_turns):
        before = _hits(engine)
        params = [common.sampling_params(args, args.output_len)] * len(histories)
        result = common.run_batch(engine, [{"prompt_token_ids": h} for h in histories], params,
                                  progress=not args.disable_tqdm, desc=f"turn {turn + 1}")
        after = _hits(engine)
        queries, hits, host, disk = (b - a for a, b in zip(before, after))
        turns.append({"turn": turn + 1, "prompt_len": len(histories[0]), "elapsed_s": result.elapsed_s,
                      "ttft_ms": common.request_report(result.outputs)["ttft_ms"],
                      "hit_rate": hits / queries if queries else 0.0, "host_hits": host, "disk_hits": disk,
                      "steps": common.step_report([result.steps])})
        elapsed += result.elapsed_s
        for history, out in zip(histories, result.outputs):
            tokens += len(history) + len(out.outputs[0].token_ids)
            history += out.outputs[0].token_ids + draw(args.append_len)
    returning = turns[1:]
    report = {
        "mode": "multi-turn",
        "args": common.args_dict(args),
        "num_conversations": args.num_conversations,
        "num_turns": args.num_turns,
        "working_set_tokens": args.num_conversations * last_len,
        "elapsed_s": elapsed,
        "total_tokens_per_s": tokens / elapsed,
        "first_turn_ttft_ms": turns[0]["ttft_ms"],
        "returning_ttft_ms": _merged_ttft(returning),
        "returning_hit_rate": (float(np.mean([t["hit_rate"] for t in returning])) if returning else None),
        "turns": turns,
        "num_preemptions": engine.stats().num_preemptions,
        "engine": common.engine_report(engine, init_s),
    }
    report["working_set_over_pool"] = report["working_set_tokens"] / (engine.runner.num_blocks *
                                                                       config.cache.block_size)
    engine.close()
    return report


def _merged_ttft(turns: list[dict[str, Any]]) -> dict[str, float] | None:
    """The returning turns' TTFT summary, weighting each turn by its requests (their percentiles averaged)."""
    stats = [t["ttft_ms"] for t in turns if t["ttft_ms"]]
    if not stats:
        return None
    counts = np.asarray([s["count"] for s in stats], np.float64)
    return {key: float(np.average([s[key] for s in stats], weights=counts)) if key != "count" else int(counts.sum())
            for key in stats[0]}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve bench multi-turn", description=__doc__.split("\n")[0])
    parser.add_argument("--num-conversations", type=int, default=64)
    parser.add_argument("--num-turns", type=int, default=3)
    parser.add_argument("--first-len", type=int, default=1024, help="prompt tokens of each conversation's turn 1")
    parser.add_argument("--append-len", type=int, default=128, help="new tokens each later turn appends")
    parser.add_argument("--output-len", type=int, default=128, help="tokens generated per turn")
    common.add_sampling_args(parser)
    common.add_engine_args(parser)
    spec.add_args(parser, several=False)
    return parser


def main(argv: list[str]) -> int:
    def body(args: argparse.Namespace) -> None:
        report = run(args)
        ret = report["returning_ttft_ms"]
        first = report["first_turn_ttft_ms"]
        print(f"Multi-turn: {report['num_conversations']} conversations x {report['num_turns']} turns in "
              f"{report['elapsed_s']:.2f} s, {report['total_tokens_per_s']:.2f} total tokens/s; working set "
              f"{report['working_set_over_pool']:.2f}x the device KV pool")
        print(f"TTFT first turns: mean {first['mean']:.2f} ms, p50 {first['p50']:.2f} ms"
              + ("" if ret is None else f"; returning turns: mean {ret['mean']:.2f} ms, p50 {ret['p50']:.2f} ms, "
                                        f"p99 {ret['p99']:.2f} ms, prefix hit rate {report['returning_hit_rate']:.1%}"))
        for t in report["turns"]:
            print(f"  turn {t['turn']}: prompt {t['prompt_len']} tokens, {t['elapsed_s']:.2f} s, hit rate "
                  f"{t['hit_rate']:.1%}, host hits {t['host_hits']}, disk hits {t['disk_hits']}")
        if (line := common.kv_line(report["engine"].get("kv_cache", {}))) is not None:
            print(line)
        common.write_json(args.output_json, report)

    return common.run_main(body, argv, build_parser())

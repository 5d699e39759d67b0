"""`jaxserve bench multi-turn`: multi-turn chat offline, the workload of the KV cache tiers.

    --num-conversations C conversations of --num-turns T turns. Turn 1 of a conversation is --first-len
    random token ids; turn t + 1 is turn t's prompt, its answer (--output-len tokens) and --append-len new
    random ids (the next user message). Two ways to send them:
      rounds (the default)  every conversation's turn t is queued at once, then every turn t + 1 (C users who
                            all answer before anyone speaks again); a returning turn's TTFT includes its wait
                            behind the turns queued before it
      --max-concurrency N   closed loop (the clients of SGLang's bench_multiturn and vLLM's multi-turn
                            bench): a conversation sends its next turn as soon as its answer is back, at most N
                            turns in the engine at once, the others waiting their turn in arrival order; a
                            turn's TTFT counts from its entry into the engine
    Either way, by its next turn a conversation's history may have left the device pool: with a host or disk
    tier (cache.host_kv_gib, cache.disk_kv_path) it comes back from there, without one it is recomputed.
    -> TTFT of the first turns and of the returning turns (t >= 2), total tokens/s over every turn (prompt
       and output tokens, each history counted at each turn), the returning turns' prefix hit rate (rounds:
       the KV cache's hit counters over the turn; closed loop: the turn's requests' cached prompt tokens) and
       (in rounds) the per-tier hits, and the KV cache report (hits, bytes moved, evictions, loads per tier).

The working set is C x the last turn's length; set the device pool with --num-blocks (cache.num_blocks) to
make it a multiple of the pool.

    jaxserve bench multi-turn --config configs/llama3-8b-dummy.yaml --num-conversations 64 --num-turns 3 \\
        --first-len 1024 --append-len 128 --output-len 128 --host-kv-gib 64 --output-json mt.json
    jaxserve bench multi-turn ... --max-concurrency 32
"""

from __future__ import annotations

import argparse
import time
from collections import deque
from typing import Any

import numpy as np
from tqdm import tqdm

from jaxserve.bench import common, spec


def _hits(engine) -> tuple[int, int, int, int]:
    kv = engine.stats().kv_cache
    return (0, 0, 0, 0) if kv is None else (kv.queries, kv.hits, kv.host_hits, kv.disk_hits)


def run(args: argparse.Namespace) -> dict[str, Any]:
    for name in ("num_conversations", "num_turns", "first_len", "output_len", "max_concurrency"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
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
    appends = [[draw(args.append_len) for _ in histories] for _ in range(args.num_turns - 1)]
    if args.max_concurrency is None:
        turns, elapsed, tokens = _rounds(engine, args, histories, appends)
        steps = None
    else:
        turns, elapsed, tokens, steps = _closed_loop(engine, args, histories, appends)
    returning = turns[1:]
    report = {
        "mode": "multi-turn",
        "args": common.args_dict(args),
        "num_conversations": args.num_conversations,
        "num_turns": args.num_turns,
        "max_concurrency": args.max_concurrency,
        "working_set_tokens": args.num_conversations * last_len,
        "elapsed_s": elapsed,
        "total_tokens_per_s": tokens / elapsed,
        "first_turn_ttft_ms": turns[0]["ttft_ms"],
        "returning_ttft_ms": _merged_ttft(returning),
        "returning_hit_rate": (float(np.mean([t["hit_rate"] for t in returning])) if returning else None),
        "turns": turns,
        "steps": steps,
        "num_preemptions": engine.stats().num_preemptions,
        "engine": common.engine_report(engine, init_s),
    }
    report["working_set_over_pool"] = report["working_set_tokens"] / (engine.runner.num_blocks *
                                                                       config.cache.block_size)
    engine.close()
    return report


def _rounds(engine, args, histories: list[list[int]], appends: list[list[list[int]]]):
    """Every conversation's turn t queued at once, then turn t + 1: (turn reports, seconds, tokens)."""
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
        for c, (history, out) in enumerate(zip(histories, result.outputs)):
            tokens += len(history) + len(out.outputs[0].token_ids)
            history += out.outputs[0].token_ids + (appends[turn][c] if turn < len(appends) else [])
    return turns, elapsed, tokens


def _closed_loop(engine, args, histories: list[list[int]], appends: list[list[list[int]]]):
    """Each conversation's next turn sent when its answer is back, at most --max-concurrency in the engine:
    (turn reports, seconds, tokens, the run's step report)."""
    engine.step_stats.clear()
    num_turns, limit = args.num_turns, args.max_concurrency
    ready = deque(range(len(histories)))  # conversations whose next turn waits for a slot, in arrival order
    next_turn = [0] * len(histories)
    outputs: list[list] = [[None] * len(histories) for _ in range(num_turns)]
    prompt_lens = [len(histories[0])] + [0] * (num_turns - 1)  # equal in a turn: answers run to --output-len
    in_flight: dict[str, int] = {}
    tokens = 0
    start = time.perf_counter()
    with tqdm(total=len(histories) * num_turns, desc="turns", disable=args.disable_tqdm, leave=False) as bar:
        while ready or in_flight:
            while ready and len(in_flight) < limit:
                c = ready.popleft()
                prepared = engine.prepare_request({"prompt_token_ids": histories[c]},
                                                  common.sampling_params(args, args.output_len))
                engine.enqueue(prepared)
                in_flight[prepared.request_id] = c
            for out in engine.step(final_only=True):
                if not out.finished or (c := in_flight.pop(out.request_id, None)) is None:
                    continue
                turn = next_turn[c]
                outputs[turn][c] = out
                answer = out.outputs[0].token_ids
                tokens += len(histories[c]) + len(answer)
                if turn + 1 < num_turns:
                    histories[c] += answer + appends[turn][c]
                    prompt_lens[turn + 1] = len(histories[c])
                    next_turn[c] += 1
                    ready.append(c)
                bar.update()
    elapsed = time.perf_counter() - start
    engine.step()  # the step still in flight under overlap (see common.run_batch)
    turns = [{"turn": turn + 1, "prompt_len": prompt_lens[turn], "elapsed_s": None,
              "ttft_ms": common.request_report(outs)["ttft_ms"],
              "hit_rate": sum(o.num_cached_tokens for o in outs) / (prompt_lens[turn] * len(outs)),
              "host_hits": None, "disk_hits": None, "steps": None}
             for turn, outs in enumerate(outputs)]
    return turns, elapsed, tokens, common.step_report([list(engine.step_stats)])


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
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="closed loop: a conversation's next turn is sent when its answer is back, at most N "
                             "turns in the engine at once (default: rounds, every conversation's turn t at once)")
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
              f"{report['working_set_over_pool']:.2f}x the device KV pool"
              + ("" if report["max_concurrency"] is None else
                 f"; closed loop, at most {report['max_concurrency']} turns in the engine"))
        print(f"TTFT first turns: mean {first['mean']:.2f} ms, p50 {first['p50']:.2f} ms"
              + ("" if ret is None else f"; returning turns: mean {ret['mean']:.2f} ms, p50 {ret['p50']:.2f} ms, "
                                        f"p99 {ret['p99']:.2f} ms, prefix hit rate {report['returning_hit_rate']:.1%}"))
        for t in report["turns"]:
            if t["elapsed_s"] is None:
                ttft = t["ttft_ms"]
                print(f"  turn {t['turn']}: prompt {t['prompt_len']} tokens, TTFT p50 {ttft['p50']:.2f} ms, "
                      f"hit rate {t['hit_rate']:.1%}")
            else:
                print(f"  turn {t['turn']}: prompt {t['prompt_len']} tokens, {t['elapsed_s']:.2f} s, hit rate "
                      f"{t['hit_rate']:.1%}, host hits {t['host_hits']}, disk hits {t['disk_hits']}")
        if (line := common.kv_line(report["engine"].get("kv_cache", {}))) is not None:
            print(line)
        common.write_json(args.output_json, report)

    return common.run_main(body, argv, build_parser())

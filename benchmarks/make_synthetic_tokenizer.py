"""A synthetic tokenizer of a model's exact vocabulary size, for serving a `load_format: dummy` model with text.

    --model-config config.json (vocab_size, bos_token_id, eos_token_id, max_position_embeddings)
      or --vocab-size N
    -> DIR/tokenizer.json        a `tokenizers` WordLevel model: id i <-> one distinct lowercase word
                                 ("a".."z", "aa".."zz", "aaa", ...), a whitespace-split pre-tokenizer and no
                                 decoder (tokenizers then joins tokens with one space)
       DIR/tokenizer_config.json bos / eos / unk special tokens, a one-line chat template

Special tokens sit at the config's bos and eos ids (else N-2 and N-1); "<unk>" takes the highest id
left (encode maps any word outside the vocabulary to it). Every other id is a word, so
encode(decode(ids)) == ids for any ids without special tokens, and decoding one more id appends
" word": jaxserve's incremental detokenizer emits one text delta per generated token, as with a real
BPE tokenizer, and a client can count tokens by re-encoding the streamed text.
The output is a function of the arguments alone (no randomness).

    python benchmarks/make_synthetic_tokenizer.py --model-config configs/models/llama3-8b/config.json \\
        --out build/synthetic-tokenizer/llama3-8b
"""

from __future__ import annotations

import argparse
import itertools
import json
import string
import sys
from pathlib import Path

import tokenizers
from tokenizers import models, pre_tokenizers

BOS, EOS, UNK = "<bos>", "<eos>", "<unk>"
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] }} {{ message['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant {% endif %}")


def words(count: int):
    """The first `count` lowercase words, shortest first, then in alphabetical order."""
    produced = itertools.chain.from_iterable(
        map("".join, itertools.product(string.ascii_lowercase, repeat=n)) for n in itertools.count(1))
    return itertools.islice(produced, count)


def special_ids(vocab_size: int, bos_id: int | None, eos_id: int | None) -> dict[str, int]:
    bos_id = vocab_size - 2 if bos_id is None else bos_id
    eos_id = vocab_size - 1 if eos_id is None else eos_id
    if vocab_size < 4:
        raise ValueError(f"--vocab-size must be >= 4 (three special tokens and a word), got {vocab_size}")
    for name, value in (("bos", bos_id), ("eos", eos_id)):
        if not 0 <= value < vocab_size:
            raise ValueError(f"{name} id {value} is outside the vocabulary [0, {vocab_size})")
    if bos_id == eos_id:
        raise ValueError(f"bos and eos ids must differ, both are {bos_id}")
    unk_id = next(i for i in range(vocab_size - 1, -1, -1) if i not in (bos_id, eos_id))
    return {BOS: bos_id, EOS: eos_id, UNK: unk_id}


def build(vocab_size: int, bos_id: int | None = None, eos_id: int | None = None,
          model_max_length: int | None = None) -> tuple[tokenizers.Tokenizer, dict]:
    """The backend tokenizer and the tokenizer_config.json dict."""
    special = special_ids(vocab_size, bos_id, eos_id)
    taken = set(special.values())
    vocab = dict(zip(words(vocab_size - len(special)), (i for i in range(vocab_size) if i not in taken)))
    vocab.update(special)
    backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in special])
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "unk_token": UNK,
        "added_tokens_decoder": {str(i): {"content": t, "special": True, "normalized": False, "lstrip": False,
                                          "rstrip": False, "single_word": False} for t, i in sorted(special.items(),
                                                                                                  key=lambda x: x[1])},
        "chat_template": CHAT_TEMPLATE,
    }
    if model_max_length is not None:
        config["model_max_length"] = model_max_length
    return backend, config


def write(out: Path, backend: tokenizers.Tokenizer, config: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    backend.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model-config", type=Path, help="a model's config.json (vocab_size, bos/eos ids)")
    source.add_argument("--vocab-size", type=int)
    parser.add_argument("--out", type=Path, required=True, help="directory to write the two files into")
    args = parser.parse_args(argv)
    try:
        if args.model_config is not None:
            try:
                cfg = json.loads(args.model_config.read_text())
            except FileNotFoundError:
                raise ValueError(f"--model-config {args.model_config} not found") from None
            eos = cfg.get("eos_token_id")
            eos = eos[0] if isinstance(eos, list) else eos
            backend, config = build(int(cfg["vocab_size"]), cfg.get("bos_token_id"), eos,
                                    cfg.get("max_position_embeddings"))
        else:
            backend, config = build(args.vocab_size)
    except (ValueError, KeyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    write(args.out, backend, config)
    print(f"wrote {args.out}/tokenizer.json ({backend.get_vocab_size()} ids) and tokenizer_config.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())

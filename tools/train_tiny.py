"""Train the embedded default model: a tiny Llama that adds two integers below 1000.

    prompt  "<s>{a}+{b}="   completion  "{a+b}</s>"      (character-level tokenizer, 16 ids)

The data is drawn on the host with a fixed seed; the loss covers only the completion tokens.
Problems of the HELD-OUT set (a fixed ~0.1% of all pairs, see `is_held_out`) never appear in
training: the accuracy test draws its problems from there. The result is written in Hugging
Face layout (config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
generation_config.json) and loads through the same loader as any HF checkpoint.

`--draft` trains a smaller Llama of the same vocabulary instead (DRAFT_CONFIG: 2 layers, width 64), the
embedded draft model of speculative decoding (`jaxserve/assets/tiny-adder-draft`); its TRAINING.md also
records how often its greedy token equals the embedded model's on held-out problems (teacher-forced: the
chance that one guess is accepted). `--eagle` trains an EAGLE head (EAGLE_CONFIG: one layer over the embedded
model's hidden states, models/eagle_head.py) for it (`jaxserve/assets/tiny-adder-eagle`): cross-entropy of
the target's next-next token plus regression onto the target's next feature, over two passes, the second
reading the head's own features (as proposing does after its first guess). `--eagle3` trains an EAGLE-3 head
(EAGLE3_CONFIG, models/eagle3_head.py: fc over the residual stream entering the target's layers 1-3, its own
lm head over a draft vocabulary of 13 ids mapped through d2t) into `jaxserve/assets/tiny-adder-eagle3`:
cross-entropy of the token two ahead over two passes, the second reading the first's pre-norm output.

Usage: `python tools/train_tiny.py --out jaxserve/assets/tiny-adder [--steps 30000]` (or `--draft`), after
`pip install -e '.[train]'` (optax). The data helpers (`held_out_problems`, `sample_batch`) need no optax:
the embedded-model tests import them.
Measured: see `jaxserve/assets/tiny-adder/TRAINING.md` (and `tiny-adder-draft/`), written by the runs that
made the weights.
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

try:
    import optax
except ImportError:  # only training needs it (the `train` extra); main() says so
    optax = None

from jaxserve.models import eagle3_head as eagle3
from jaxserve.models import eagle_head as eagle
from jaxserve.models import layers, llama, loader, registry

VOCAB = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{c: i + 4 for i, c in enumerate("0123456789+=")}}
PAD, BOS, EOS = 0, 1, 2
SEQ_LEN = 14  # <s> ddd + ddd = dddd </s>
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ message['content'] | trim }}{% if not message['content'].rstrip().endswith('=') %}={% endif %}"
    "{% endif %}{% endfor %}"
)

# The model, as the config.json it is saved with describes it.
MODEL_CONFIG = registry.config_from_hf({
    "architectures": ["LlamaForCausalLM"], "vocab_size": len(VOCAB), "hidden_size": 128, "intermediate_size": 384,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "max_position_embeddings": 32, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True,
    "torch_dtype": "float32"})
# The draft model of speculative decoding: the same vocabulary and context, a fraction of the compute.
DRAFT_CONFIG = registry.config_from_hf({
    "architectures": ["LlamaForCausalLM"], "vocab_size": len(VOCAB), "hidden_size": 64, "intermediate_size": 192,
    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
    "max_position_embeddings": 32, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True,
    "torch_dtype": "float32"})
# The EAGLE head of the embedded model: one decoder layer of the target's width (it uses the target's
# embedding and lm head).
EAGLE_CONFIG = registry.config_from_hf({
    "architectures": ["LlamaForCausalLM"], "vocab_size": len(VOCAB), "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "max_position_embeddings": 32, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True,
    "torch_dtype": "float32"})
FAMILY = registry.family_of(MODEL_CONFIG)
# The EAGLE-3 head of the embedded model: one layer of the target's width over the residual stream entering
# its layers 1, 2 and 3 (the default (2, L // 2, L - 3) names layer 2 twice in a 4-layer model), with its own
# lm head over a draft vocabulary without the ids no completion holds (<pad>, <s>, <unk>).
DRAFT_IDS = np.array([i for i in range(len(VOCAB)) if i not in (PAD, BOS, VOCAB["<unk>"])])
EAGLE3_CONFIG = eagle3.Eagle3Config(layer=EAGLE_CONFIG, draft_vocab_size=len(DRAFT_IDS),
                                    target_hidden_size=MODEL_CONFIG.hidden_size, aux_layers=(1, 2, 3))


def is_held_out(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The fixed evaluation set: about 1 in 1000 of all (a, b) pairs, by a multiplicative hash."""
    key = (a.astype(np.uint64) * 1000 + b.astype(np.uint64)) * np.uint64(2654435761)
    return (key % np.uint64(2**32)) < np.uint64(2**32 // 1000)


def held_out_problems() -> list[tuple[int, int]]:
    a, b = np.meshgrid(np.arange(1000), np.arange(1000), indexing="ij")
    mask = is_held_out(a, b)
    return list(zip(a[mask].tolist(), b[mask].tolist()))


def _digits(x: np.ndarray) -> np.ndarray:
    """Decimal digits as token ids [n, 4], most significant first, -1 where a number is shorter."""
    num_digits = 1 + (x >= 10) + (x >= 100) + (x >= 1000)
    place = num_digits[:, None] - 1 - np.arange(4)[None, :]
    digit = (x[:, None] // 10 ** np.maximum(place, 0)) % 10
    return np.where(place >= 0, digit + VOCAB["0"], -1)


def encode_problems(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Token rows [n, SEQ_LEN] (right-padded) and a loss mask over the completion targets."""
    n = len(a)
    col = lambda v: np.full((n, 1), v)  # noqa: E731
    pieces = np.concatenate([col(BOS), _digits(a), col(VOCAB["+"]), _digits(b), col(VOCAB["="]),
                             _digits(a + b), col(EOS)], axis=1)
    order = np.argsort(pieces == -1, axis=1, kind="stable")  # squeeze out the gaps, keep order
    rows = np.take_along_axis(pieces, order, axis=1)[:, :SEQ_LEN]
    rows = np.where(rows == -1, PAD, rows).astype(np.int32)
    prompt_len = 3 + (_digits(a) >= 0).sum(1) + (_digits(b) >= 0).sum(1)
    completion_len = 1 + (_digits(a + b) >= 0).sum(1)
    pos = np.arange(SEQ_LEN)[None, :]
    # Position t predicts token t + 1: mark positions whose NEXT token belongs to the completion.
    mask = (pos >= prompt_len[:, None] - 1) & (pos < (prompt_len + completion_len)[:, None] - 1)
    return rows, mask.astype(np.float32)


def sample_batch(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Half uniform pairs, half with uniformly drawn digit counts (so short numbers are seen too)."""
    a = rng.integers(0, 1000, n)
    b = rng.integers(0, 1000, n)
    short = rng.random(n) < 0.5
    a = np.where(short, rng.integers(0, 10 ** rng.integers(1, 4, n)), a)
    b = np.where(short, rng.integers(0, 10 ** rng.integers(1, 4, n)), b)
    rows, mask = encode_problems(a, b)
    mask[is_held_out(a, b)] = 0.0  # held-out problems carry no gradient
    return rows, mask


def loss_fn(params, rows, mask, target=None, cfg=MODEL_CONFIG):
    logits = FAMILY.forward_dense(params, cfg, rows)
    targets = jnp.roll(rows, -1, axis=1)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def _eagle_inputs(target, rows, mask):
    """(token p + 1's embedding at p, the target's features [B, L, D], the mask of positions p whose token
    p + 2 is a completion token)."""
    _, features = FAMILY.forward_dense(target, MODEL_CONFIG, rows, return_hidden=True)
    return target["embed"][jnp.roll(rows, -1, axis=1)], jax.lax.stop_gradient(features), jnp.roll(mask, -1, axis=1)


def eagle_loss(params, rows, mask, target, cfg=EAGLE_CONFIG):
    embeds, features, mask = _eagle_inputs(target, rows, mask)
    targets, next_features = jnp.roll(rows, -2, axis=1), jnp.roll(features, -1, axis=1)
    weight = mask / jnp.maximum(jnp.sum(mask), 1.0)
    loss, inputs = 0.0, features
    for _ in range(2):
        x = eagle.forward_dense(params, cfg, embeds, inputs)
        nll = optax.softmax_cross_entropy_with_integer_labels(FAMILY.head_logits(target, MODEL_CONFIG, x), targets)
        regression = jnp.mean(optax.huber_loss(x, next_features), axis=-1)
        loss += jnp.sum((nll + regression) * weight)
        inputs = jnp.concatenate([features[:, :1], x[:, :-1]], axis=1)  # p reads the head's guess of f_p
    return loss


def eagle_agreement(params, target, problems: list[tuple[int, int]], cfg=EAGLE_CONFIG) -> float:
    """How often the head's first guess (from the target's features) equals the target's greedy token at the
    completion positions of `problems` (teacher-forced)."""
    rows, mask = encode_problems(np.array([p[0] for p in problems]), np.array([p[1] for p in problems]))
    embeds, features, mask = _eagle_inputs(target, rows, mask)
    guess = np.argmax(np.asarray(FAMILY.head_logits(target, MODEL_CONFIG,
                                                    eagle.forward_dense(params, cfg, embeds, features))), axis=-1)
    greedy = np.roll(np.argmax(np.asarray(FAMILY.forward_dense(target, MODEL_CONFIG, rows)), axis=-1), -1, axis=1)
    return float(((guess == greedy) * np.asarray(mask)).sum() / np.asarray(mask).sum())


def target_aux(target, rows, aux_layers=EAGLE3_CONFIG.aux_layers):
    """The target's residual stream entering each of `aux_layers`, concatenated [B, L, n * D] (as
    llama.forward's aux_layers, over a dense causal batch)."""
    cfg = MODEL_CONFIG
    inv_freq = layers.rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    batch, length = rows.shape
    x = target["embed"][rows.reshape(-1)]
    h = layers.rms_norm(x, target["layers"][0]["attn_norm"], cfg.rms_norm_eps)
    aux = []
    for i, (lp, next_norm) in enumerate(zip(target["layers"], llama._next_norms(target))):
        if i in aux_layers:
            aux.append(x)
        q, k, v = (a.reshape(batch, length, *a.shape[1:]) for a in
                   llama._qkv(lp, cfg, h, jnp.tile(jnp.arange(length, dtype=jnp.int32), batch), inv_freq))
        attn = layers.causal_attention(q, k, v, sm_scale=cfg.head_dim ** -0.5)
        h, x = llama._out_and_mlp(lp, cfg, x, attn.reshape(batch * length, *attn.shape[2:]), next_norm)
    return jax.lax.stop_gradient(jnp.concatenate(aux, axis=-1).reshape(batch, length, -1))


def _eagle3_targets(rows):
    """Each position's token two ahead as a draft id (ids outside the draft vocabulary: 0, masked anyway)."""
    to_draft = np.zeros(len(VOCAB), np.int32)
    to_draft[DRAFT_IDS] = np.arange(len(DRAFT_IDS))
    return jnp.asarray(to_draft)[jnp.roll(rows, -2, axis=1)]


def eagle3_loss(params, rows, mask, target, head=EAGLE3_CONFIG):
    """Cross-entropy of the token two ahead over two passes: the first reads fc(the target's aux states),
    the second the first's pre-norm output one position back (as proposing does after its first guess)."""
    embeds = target["embed"][jnp.roll(rows, -1, axis=1)]
    targets, mask = _eagle3_targets(rows), jnp.roll(mask, -1, axis=1)
    weight = mask / jnp.maximum(jnp.sum(mask), 1.0)
    hidden = eagle3.features(params, target_aux(target, rows))
    loss = 0.0
    for _ in range(2):
        normed, out = eagle3.forward_dense(params, head, embeds, hidden)
        nll = optax.softmax_cross_entropy_with_integer_labels(eagle3.logits(params, normed), targets)
        loss += jnp.sum(nll * weight)
        hidden = jnp.concatenate([hidden[:, :1], out[:, :-1]], axis=1)
    return loss


def eagle3_agreement(params, target, problems: list[tuple[int, int]], head=EAGLE3_CONFIG) -> float:
    """eagle_agreement for the EAGLE-3 head: its first guess mapped to a target id against the target's
    greedy token."""
    rows, mask = encode_problems(np.array([p[0] for p in problems]), np.array([p[1] for p in problems]))
    embeds = target["embed"][jnp.roll(rows, -1, axis=1)]
    normed, _ = eagle3.forward_dense(params, head, embeds, eagle3.features(params, target_aux(target, rows)))
    guess = DRAFT_IDS[np.argmax(np.asarray(eagle3.logits(params, normed)), axis=-1)]
    greedy = np.roll(np.argmax(np.asarray(FAMILY.forward_dense(target, MODEL_CONFIG, rows)), axis=-1), -1, axis=1)
    mask = np.roll(mask, -1, axis=1)
    return float(((guess == greedy) * mask).sum() / mask.sum())


@partial(jax.jit, static_argnums=(0, 1), donate_argnums=(2, 3))
def train_chunk(optimizer, loss, params, opt_state, rows, masks, target=None):
    """Several optimizer steps in one device call: rows, masks [steps, batch, SEQ_LEN]; `loss`(params, rows,
    mask, target)."""
    def step(carry, batch):
        params, opt_state = carry
        loss_value, grads = jax.value_and_grad(loss)(params, *batch, target)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss_value

    (params, opt_state), losses = jax.lax.scan(step, (params, opt_state), (rows, masks))
    return params, opt_state, losses


@partial(jax.jit, static_argnums=(2,))
def greedy_answers(params, prompts, cfg=MODEL_CONFIG):
    """Greedy-decode 5 tokens after each prompt. prompts [n, SEQ_LEN]: the prompt, then padding."""
    lengths = jnp.sum(prompts != PAD, axis=1)

    def step(i, rows):
        logits = FAMILY.forward_dense(params, cfg, rows)
        pos = lengths + i - 1
        nxt = jnp.argmax(logits[jnp.arange(rows.shape[0]), pos], axis=-1).astype(rows.dtype)
        return rows.at[jnp.arange(rows.shape[0]), jnp.minimum(pos + 1, SEQ_LEN - 1)].set(nxt)

    return jax.lax.fori_loop(0, 5, step, prompts)


def accuracy(params, problems: list[tuple[int, int]], cfg=MODEL_CONFIG) -> float:
    a = np.array([p[0] for p in problems])
    b = np.array([p[1] for p in problems])
    rows, mask = encode_problems(a, b)
    prompt_len = np.array([len(f"{x}+{y}=") + 1 for x, y in problems])
    prompts = np.where(np.arange(SEQ_LEN)[None] < prompt_len[:, None], rows, PAD)
    out = np.asarray(greedy_answers(params, prompts, cfg))
    correct = [np.array_equal(out[i, prompt_len[i]: prompt_len[i] + len(str(x + y)) + 1], rows[i, prompt_len[i]:
               prompt_len[i] + len(str(x + y)) + 1]) for i, (x, y) in enumerate(problems)]
    return float(np.mean(correct))


def write_tokenizer(out: Path) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    tok.add_special_tokens(["<pad>", "<s>", "</s>", "<unk>"])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>",
        "add_bos_token": True, "model_max_length": MODEL_CONFIG.max_position_embeddings,
        "chat_template": CHAT_TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast",
    }, indent=2) + "\n")


def agreement(params, cfg, target_params, problems: list[tuple[int, int]]) -> float:
    """How often the model's greedy token equals the target's (the embedded model's) at the completion
    positions of `problems`, both reading the same correct prefix: the rate at which a draft's guess is
    accepted when the guesses before it were."""
    a = np.array([p[0] for p in problems])
    b = np.array([p[1] for p in problems])
    rows, mask = encode_problems(a, b)
    ours = np.argmax(np.asarray(FAMILY.forward_dense(params, cfg, rows)), axis=-1)
    theirs = np.argmax(np.asarray(FAMILY.forward_dense(target_params, MODEL_CONFIG, rows)), axis=-1)
    return float(((ours == theirs) * mask).sum() / mask.sum())


def save(params, out: Path, notes: str, cfg=MODEL_CONFIG) -> None:
    out.mkdir(parents=True, exist_ok=True)
    loader.save_safetensors(params, cfg, out / "model.safetensors")
    hf = registry.to_hf_config(cfg, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD, "do_sample": False}, indent=2) + "\n")
    write_tokenizer(out)
    (out / "TRAINING.md").write_text(notes)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="tools/train_tiny.py", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="default: jaxserve/assets/tiny-adder, or tiny-adder-draft with --draft")
    parser.add_argument("--draft", action="store_true",
                        help="train the draft model (DRAFT_CONFIG) instead of the embedded model")
    parser.add_argument("--eagle", action="store_true",
                        help="train the embedded model's EAGLE head (EAGLE_CONFIG) instead")
    parser.add_argument("--eagle3", action="store_true",
                        help="train the embedded model's EAGLE-3 head (EAGLE3_CONFIG) instead")
    parser.add_argument("--target", type=Path, default=Path("jaxserve/assets/tiny-adder"),
                        help="--draft, --eagle, --eagle3: the model whose guesses it makes")
    parser.add_argument("--steps", type=int, default=30000)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chunk", type=int, default=500, help="optimizer steps per device call")
    args = parser.parse_args(argv)
    if optax is None:
        raise SystemExit("training needs optax: pip install -e '.[train]'")

    cfg = EAGLE_CONFIG if args.eagle else DRAFT_CONFIG if args.draft else MODEL_CONFIG
    name = ("tiny-adder-eagle3" if args.eagle3 else "tiny-adder-eagle" if args.eagle else
            "tiny-adder-draft" if args.draft else "tiny-adder")
    out = args.out or Path("jaxserve/assets") / name
    rng = np.random.default_rng(args.seed)
    heads = args.eagle or args.eagle3  # (either head: agreement instead of accuracy)
    target = loader.load_model(args.target, dtype="float32").params if args.draft or heads else None
    if args.eagle3:  # (its final norm and lm head start as the target's, over the draft ids)
        params, loss = eagle3.init_head(EAGLE3_CONFIG, jax.random.key(args.seed)), eagle3_loss
        params |= {"final_norm": jnp.array(target["final_norm"], copy=True), "lm_head": target["embed"][DRAFT_IDS].T}
    elif args.eagle:
        params, loss = eagle.init_head(cfg, jax.random.key(args.seed)), eagle_loss
    else:
        params, loss = FAMILY.init_params(cfg, jax.random.key(args.seed), std=0.02), partial(loss_fn, cfg=cfg)
    warmup = min(1000, args.steps // 10)
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, args.steps, end_value=args.lr * 0.01)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.98, weight_decay=0.01))
    opt_state = optimizer.init(params)
    held_out = held_out_problems()
    eval_set = [held_out[i] for i in np.random.default_rng(1).permutation(len(held_out))[:1000]]
    log = []
    start = time.time()
    for done in range(0, args.steps, args.chunk):
        n = min(args.chunk, args.steps - done)
        batches = [sample_batch(rng, args.batch_size) for _ in range(n)]
        rows = np.stack([b[0] for b in batches])
        masks = np.stack([b[1] for b in batches])
        params, opt_state, losses = train_chunk(optimizer, loss, params, opt_state, rows, masks, target)
        if (done + n) % (args.chunk * 4) == 0 or done + n == args.steps:
            acc = (eagle3_agreement(params, target, eval_set) if args.eagle3 else
                   eagle_agreement(params, target, eval_set) if args.eagle else accuracy(params, eval_set, cfg))
            what = "agreement" if heads else "acc"
            line = (f"step {done + n:6d}  loss {float(losses[-1]):.4f}  held-out {what} {acc:.4f}  "
                    f"{time.time() - start:.0f}s")
            print(line, flush=True)
            log.append(line)
    flags = " --eagle3" if args.eagle3 else " --eagle" if args.eagle else " --draft" if args.draft else ""
    notes = (
        f"# {name} training record\n\nCommand: `python tools/train_tiny.py{flags} --steps {args.steps} --batch-size "
        f"{args.batch_size} --lr {args.lr} --seed {args.seed}`\n\nDevice: {jax.devices()[0].device_kind}; wall time "
        f"{time.time() - start:.0f} s (data drawn on the host).\n"
    )
    if not heads:
        notes += (f"\nHeld-out accuracy (all {len(held_out)} held-out problems, greedy): "
                  f"{accuracy(params, held_out, cfg):.4f}\n")
    if target is not None:
        rate = (eagle3_agreement(params, target, held_out) if args.eagle3 else eagle_agreement(params, target, held_out)
                if args.eagle else agreement(params, cfg, target, held_out))
        notes += (f"\nAgreement with {args.target.name} (its first guess equals the greedy token at the completion "
                  f"positions of every held-out problem, teacher-forced: the rate at which one guess is accepted): "
                  f"{rate:.4f}\n")
    notes += "\n```\n" + "\n".join(log) + "\n```\n"
    print(notes)
    if args.eagle3:
        eagle3.save_head(params, EAGLE3_CONFIG, out, d2t=DRAFT_IDS - np.arange(len(DRAFT_IDS)))
        (out / "TRAINING.md").write_text(notes)
    elif args.eagle:
        out.mkdir(parents=True, exist_ok=True)
        eagle.save_head(params, cfg, out)
        (out / "TRAINING.md").write_text(notes)
    else:
        save(params, out, notes, cfg)


if __name__ == "__main__":
    main()

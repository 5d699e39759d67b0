"""The scheduler's side of n-gram speculative decoding (host only; numpy, no JAX).

    Scheduler.schedule():  propose(running) -> request id -> guesses; a decode row with guesses is a
                           ScheduledRequest of 1 + n tokens (draft_token_ids), counted in the budget,
                           its KV slots allocated, and one logits row per guess taken from those no
                           running request holds (the runner has max_num_seqs)
    update_from_output():  accept(request, guesses, token, num_accepted) appends the accepted guesses and
                           the runner's token with the usual stop checks, rolls num_computed_tokens back
                           past the rejected positions; the scheduler then frees the blocks only they used
                           (KVCacheManager.trim) and tells the runner (SchedulerOutput.truncated_block_tables)

A request's token count after a step with guesses is unknown until that step is processed
(Request.draft_token_ids marks the step in flight). Under overlap a row without penalties, min_tokens bans
or logprobs then takes the next step as a device-guessed row (`device_guessed_row`, below) where the runner
proposes n-grams on device too (one process); otherwise it takes one plain token in the next step all the
same (`may_defer`): scheduled at the position it has if no guess is kept, moved on device by the count the
verify step keeps (runner/step_program.py).

A draft model (draft_model, eagle) guesses on the device instead, during a step, from the token that step
samples: the scheduler gives such a row `lookahead` more KV slots (the draft writes the K/V of its k
guesses), keeps the drafts that come back (`keep_proposal`: Request.proposal) and `propose` makes them the
row's guesses in its next step. Under overlap a row's next step is scheduled while the step that drafted
for it is still in flight. A row without penalties, min_tokens bans or logprobs (`device_guesses`) then
takes that step as a device-guessed row:
its token and guesses are the previous step's outputs, read on device, at the position that step's kept
count gives, so every step of the row verifies guesses. Another row behind its verify step sits that step
out; a row behind a plain step that drafted goes on without guesses, and in the step after the proposal
is one token behind: its first guess stands for the token still in flight and is dropped, as the n-gram
proposer does.
"""

from __future__ import annotations

from jaxserve.config import SpeculativeConfig
from jaxserve.core.sched_types import ScheduledRequest
from jaxserve.request import Request, RequestStatus
from jaxserve.spec_decode.ngram import propose_sequences


def may_guess(request: Request) -> bool:
    """Every request may guess, whatever its sampling: verification (runner/spec_verify.py) samples each
    guessed position with the engine's sampler under the metadata of the output token it stands for
    (noise step, penalty history including the earlier guesses, min_tokens bans), so a row's outputs
    are those it would sample without guesses, greedy or random, with or without penalties."""
    del request
    return True


def _can_take_guesses(request: Request) -> bool:
    """A decode row (its one new token is its last known one, at most that one in flight) whose guessed
    step is not in flight, with room for one guess within its token limit."""
    known = len(request.all_token_ids) + request.num_pending
    return (request.num_pending <= 1 and not request.draft_token_ids
            and request.num_computed_tokens == known - 1 and known + 2 <= request.token_limit
            and may_guess(request))


def may_defer(request: Request, max_model_len: int) -> bool:
    """A row whose verify step is in flight may take one plain token right behind it (Scheduler.schedule:
    its position is known only on device) when the token has room if every guess is kept."""
    return request.num_computed_tokens + 1 <= max_model_len and request.num_pending == 1


def device_guesses(request: Request, spec: SpeculativeConfig, max_model_len: int) -> int:
    """How many guesses a draft model's row takes right behind its own verify step, still in flight (a
    device-guessed row: its token and guesses are that step's outputs on device), 0 when it sits the step
    out: only a row without penalties, min_tokens bans or logprobs (its sampling then needs nothing the host
    does not know yet: a random row's noise steps move on device with the count kept), one step in flight,
    at most k guesses and, if every guess in flight is kept, within its token limit and max_model_len."""
    params = request.sampling_params
    if (request.num_pending != 1 or params.logprobs is not None
            or params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
            or len(request.all_token_ids) + 1 - request.num_prompt_tokens < params.min_tokens):
        return 0
    most = len(request.all_token_ids) + request.num_pending + len(request.draft_token_ids)  # all kept
    return max(0, min(spec.num_speculative_tokens, request.token_limit - most - 1,
                      max_model_len - request.num_computed_tokens - 1))


def device_guessed_row(scheduler, request: Request, budget: int, guess_rows: int,
                       drafting: set[str]) -> ScheduledRequest | None:
    """Scheduler.schedule's device-guessed row for `request` (its verify step in flight), or None when it
    sits the step out (not eligible, no budget, no logits rows or no KV room). Its tokens are placed at
    the position of "none kept" (the runner moves them on device by the count kept), with slots for
    "all kept" and the draft's lookahead; accept() of the verify step rolls num_computed_tokens back past
    its rejected guesses, this step's tokens included."""
    threshold = scheduler.config.long_prefill_token_threshold  # (a step's tokens per request, when set)
    guess = min(device_guesses(request, scheduler.speculative, scheduler.max_model_len), budget - 1, guess_rows,
                (threshold or budget) - 1)
    if guess <= 0:
        return None
    computed = request.num_computed_tokens
    extra = scheduler._lookahead(request, computed + 1 + guess) if scheduler._lookahead is not None else 0
    new_blocks = scheduler.kv_cache.allocate_slots(request, 1 + guess + extra)
    if new_blocks is None:
        return None
    if extra:
        drafting.add(request.request_id)
    request.next_guesses = guess
    scheduler.num_device_guessed += 1
    return ScheduledRequest(request.request_id, request.row, computed - len(request.draft_token_ids), 1 + guess,
                            new_blocks, device_guesses=guess)


def propose(running: list[Request], spec: SpeculativeConfig) -> dict[str, list[int]]:
    """The guesses of the running decode rows (request id -> guesses): n-gram lookups, or the draft model's
    proposals, capped so that the guesses and the step's own token stay within each request's token limit."""
    if spec.uses_model:
        proposals = {}
        for request in running:
            if request.proposal is not None and _can_take_guesses(request):
                guesses = _current(request, request.proposal)
                if spec.synthetic_acceptance is not None:
                    guesses = pad_guesses(guesses, spec.num_speculative_tokens, request.all_token_ids[-1])
                if guesses:
                    known = len(request.all_token_ids) + request.num_pending
                    proposals[request.request_id] = guesses[:request.token_limit - known - 1]
        return proposals
    return propose_ngram(running, spec)


def _current(request: Request, proposal: tuple[int, list[int]]) -> list[int]:
    """A draft model's proposal (the token index its first guess stands for, guesses) as guesses for the
    request's next token on: the guesses for tokens known since it was made are dropped (those on the host
    must equal them; one still in flight is taken as guessed: verification checks every guess)."""
    start, guesses = proposal
    tokens = request.all_token_ids
    on_host = len(tokens) - start
    skip = on_host + request.num_pending
    if on_host < 0 or skip >= len(guesses) or tokens[start:] != guesses[:on_host]:
        return []
    return guesses[skip:]


def lookahead(request: Request, end: int, spec: SpeculativeConfig, max_model_len: int) -> int:
    """KV slots a draft model writes past a step's tokens for `request` (`end`: its computed tokens after
    the step): k where the step samples the request and it could take guesses in a later step, else 0 (the
    runner's drafts of such a row are not kept). Positions stay below max_model_len (the block tables' room)."""
    k = spec.num_speculative_tokens
    known = len(request.all_token_ids) + request.num_pending
    if end < known or end + k > max_model_len or known + 3 > request.token_limit:
        return 0
    return k if may_guess(request) else 0


def keep_proposal(request: Request, drafts: list[int]) -> None:
    """A step's drafts for a request whose new tokens are appended: they guess its tokens from the next on."""
    request.proposal = (len(request.all_token_ids), drafts)


def propose_ngram(running: list[Request], spec: SpeculativeConfig) -> dict[str, list[int]]:
    """N-gram guesses for the running decode rows, capped so that the guesses and the step's own token
    stay within each request's token limit.

    Under overlap a row's input token may still be in flight (num_pending == 1): the guesses then come
    from the tokens on the host, the match's first continuation token standing for the pending one and
    dropped. The device verifies every guess against the real tokens, so a wrong stand-in costs only
    acceptance, never correctness.
    """
    eligible = [request for request in running if _can_take_guesses(request)]
    if not eligible:
        return {}
    k = spec.num_speculative_tokens
    drafts = propose_sequences([request.all_token_ids for request in eligible], k + 1, *spec.lookup_range)
    proposals = {}
    for request, guesses in zip(eligible, drafts):
        known = len(request.all_token_ids) + request.num_pending
        guesses = guesses[request.num_pending:request.num_pending + k]
        if spec.synthetic_acceptance is not None:
            guesses = pad_guesses(guesses, k, request.all_token_ids[-1])
        if guesses:
            proposals[request.request_id] = guesses[:request.token_limit - known - 1]
    return proposals


def pad_guesses(guesses: list[int], k: int, filler: int) -> list[int]:
    """Synthetic acceptance (the bench's, SpeculativeConfig.synthetic_acceptance): every row guesses k
    tokens, the proposer's then `filler`; verification accepts them by a random draw, not by value."""
    return guesses + [filler] * (k - len(guesses))


def count_accepted(per_position: list[int], num_guesses: int, accepted: int) -> None:
    """Adds one draft of `num_guesses` guesses, the first `accepted` of them accepted, to the per-position
    acceptance counts (one entry per guess position seen)."""
    per_position.extend([0] * (num_guesses - len(per_position)))
    for j in range(accepted):
        per_position[j] += 1


def accept(request: Request, guesses: list[int], token: int, accepted: int,
           scheduled: int | None = None) -> tuple[list[int], RequestStatus | None, int | None]:
    """A row's verified step: its first `accepted` guesses, then `token`, appended one by one with the
    stop checks of Scheduler.update_from_output (a stop inside the run ends it exactly there); the
    rejected positions (of `scheduled` guessed positions, default len(guesses): a device-guessed row's
    guesses may be fewer, cut at a proposer's "no guess") leave num_computed_tokens. -> (new tokens,
    finish status or None, stop reason).
    A device-guessed step scheduled behind it becomes the row's step with guesses in flight (its guesses
    are the drafts on device: placeholders here, the runner reports them with its outputs)."""
    request.draft_token_ids = [-1] * request.next_guesses
    request.next_guesses = 0
    if not 0 <= accepted <= len(guesses):
        raise ValueError(f"{request.request_id!r}: the runner accepted {accepted} of {len(guesses)} guesses")
    request.num_computed_tokens -= (len(guesses) if scheduled is None else scheduled) - accepted
    all_tokens = request.all_token_ids
    run = []
    for new_token in guesses[:accepted] + [token]:
        all_tokens.append(new_token)
        run.append(new_token)
        if len(all_tokens) >= request.token_limit:
            return run, RequestStatus.FINISHED_LENGTH, None
        if new_token in request.stop_ids and len(all_tokens) >= request.min_stop_len:
            eos = new_token in request.eos_token_ids and not request.sampling_params.ignore_eos
            return run, RequestStatus.FINISHED_STOPPED, None if eos else new_token
    return run, None, None

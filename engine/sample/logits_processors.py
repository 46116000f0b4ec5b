"""The sampling fields that change logits before the sampler sees them, batched over a
step's rows, in vLLM's order (vllm/v1/sample/sampler.py) and with its definitions:

    logits (grammar-masked) ─▶ allowed_token_ids ─▶ bad_words ─▶ min_tokens ─▶ logit_bias
        ─▶ repetition_penalty ─▶ frequency / presence penalties ─▶ sample(): temperature, top-k ...

    allowed_token_ids   every other token -inf
    bad_words           a word's last token -inf where the output ends with the rest of it
    min_tokens          EOS and stop_token_ids -inf while the output is shorter (EOS even under
                        ignore_eos, as vLLM's all_stop_token_ids)
    logit_bias          added
    repetition_penalty  tokens of the prompt or the output: logit / p if logit > 0, else logit * p
    frequency_penalty   minus p * (times the token is in the output)
    presence_penalty    minus p where that count is > 0

"The output" of a row is every token generated so far, wherever (a prefill worker's first
token, the tokens before a migration), plus, on a draft's row, the drafts before it: each
scored row sees the state it would have if those drafts were accepted (rejection.py). The
work is a few tensors per step over the rows that ask for it, never a loop over the
vocabulary; a batch where no row asks (SamplingParams.processes_logits) never comes here.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.engine.sampling_params import SamplingParams

_NEG_INF = float("-inf")


@dataclass(frozen=True)
class RowHistory:
    """What one logits row's processing reads besides its logits."""
    params: SamplingParams
    output_token_ids: Sequence[int]
    prompt_token_ids: torch.Tensor | None = None  # only read for repetition_penalty != 1


def process_logits(logits: torch.Tensor, rows: list[RowHistory], eos_token_ids: frozenset[int]) -> torch.Tensor:
    """A new tensor: `logits` [len(rows), vocab] processed row by row as above. A row its
    masks leave without any token (allowed_token_ids beside a grammar that forbids them
    all; min_tokens where the grammar allows only EOS) keeps its logits unprocessed rather
    than sampling from nothing."""
    out = logits.clone()
    bans = _bad_word_bans(rows) + _min_tokens_bans(rows, eos_token_ids)
    masked = _mask_disallowed(out, rows) or bool(bans)
    _ban(out, bans)
    _add_bias(out, rows)
    _penalise(out, rows)
    if not masked:  # biases and penalties are finite: only a mask can leave a row nothing
        return out
    empty = torch.isneginf(out).all(dim=-1, keepdim=True)
    return torch.where(empty, logits, out)


def _indices(rows: list[RowHistory], wanted) -> list[int]:
    return [i for i, row in enumerate(rows) if wanted(row.params)]


def _mask_disallowed(out: torch.Tensor, rows: list[RowHistory]) -> bool:
    """Whether any row has allowed_token_ids (and so was masked)."""
    idx = _indices(rows, lambda p: p.allowed_token_ids is not None)
    if not idx:
        return False
    row_of = [n for n, i in enumerate(idx) for _ in rows[i].params.allowed_token_ids]
    token_ids = [t for i in idx for t in rows[i].params.allowed_token_ids]
    keep = torch.zeros(len(idx), out.shape[-1], dtype=torch.bool, device=out.device)
    keep[torch.tensor(row_of, device=out.device), torch.tensor(token_ids, device=out.device)] = True
    at = torch.tensor(idx, device=out.device)
    out[at] = out[at].masked_fill(~keep, _NEG_INF)
    return True


def _bad_word_bans(rows: list[RowHistory]) -> list[tuple[int, int]]:
    """(row, token) pairs: the last token of every bad word whose other tokens end the output
    (a one-token word: always), as transformers' NoBadWordsLogitsProcessor over the output."""
    bans = []
    for i, row in enumerate(rows):
        output = row.output_token_ids
        for word in row.params.bad_words_token_ids:
            prefix = word[:-1]
            if len(prefix) <= len(output) and list(output[len(output) - len(prefix):]) == prefix:
                bans.append((i, word[-1]))
    return bans


def _min_tokens_bans(rows: list[RowHistory], eos_token_ids: frozenset[int]) -> list[tuple[int, int]]:
    bans = []
    for i, row in enumerate(rows):
        p = row.params
        if len(row.output_token_ids) < p.min_tokens:
            stops = set(p.stop_token_ids) | set(eos_token_ids)
            bans += [(i, t) for t in sorted(stops)]
    return bans


def _ban(out: torch.Tensor, bans: list[tuple[int, int]]) -> None:
    if bans:
        at = torch.tensor(bans, device=out.device)
        out[at[:, 0], at[:, 1]] = _NEG_INF


def _add_bias(out: torch.Tensor, rows: list[RowHistory]) -> None:
    entries = [(i, t, b) for i, row in enumerate(rows) for t, b in (row.params.logit_bias or {}).items()]
    if entries:
        at = torch.tensor([(i, t) for i, t, _ in entries], device=out.device)
        bias = torch.tensor([b for _, _, b in entries], dtype=out.dtype, device=out.device)
        out.index_put_((at[:, 0], at[:, 1]), bias, accumulate=True)


def _penalise(out: torch.Tensor, rows: list[RowHistory]) -> None:
    """The three penalties, on the (row, token) entries they can change only: the tokens of a
    row's output, and of its prompt under a repetition penalty; every other entry is left as
    it is, which is what the dense definition does to it (a few thousand entries a step
    instead of batch x vocabulary)."""
    idx = _indices(rows, lambda p: p.repetition_penalty != 1.0 or p.frequency_penalty != 0
                   or p.presence_penalty != 0)
    if not idx:
        return
    dev, vocab = out.device, out.shape[-1]
    params = [rows[i].params for i in idx]
    # keys: place among the penalised rows * vocab + token
    output = _keys([torch.tensor(list(rows[i].output_token_ids), dtype=torch.long, device=dev) for i in idx],
                   range(len(idx)), vocab, dev)
    repeating = [n for n, (i, p) in enumerate(zip(idx, params))
                 if p.repetition_penalty != 1.0 and rows[i].prompt_token_ids is not None]
    prompt = _keys([rows[idx[n]].prompt_token_ids.to(dev) for n in repeating], repeating, vocab, dev)
    keys, inverse = torch.unique(torch.cat([output, prompt]), return_inverse=True)
    if not len(keys):
        return
    counts = torch.zeros(len(keys), dtype=out.dtype, device=dev)
    counts.index_add_(0, inverse[:len(output)], torch.ones(len(output), dtype=out.dtype, device=dev))
    of, token = keys // vocab, keys % vocab
    row = torch.tensor(idx, device=dev)[of]
    values = out[row, token]
    repetition = _column([p.repetition_penalty for p in params], out)[of, 0]
    values = torch.where(values > 0, values / repetition, values * repetition)
    values = values - _column([p.frequency_penalty for p in params], out)[of, 0] * counts
    values = values - _column([p.presence_penalty for p in params], out)[of, 0] * (counts > 0).to(out.dtype)
    out[row, token] = values


def _keys(token_ids: list[torch.Tensor], row_of: Sequence[int], vocab: int, dev: torch.device) -> torch.Tensor:
    """row * vocab + token for every id of each row's ids (repeats kept: they are counted)."""
    if not token_ids:
        return torch.empty(0, dtype=torch.long, device=dev)
    lengths = torch.tensor([len(t) for t in token_ids], dtype=torch.long, device=dev)
    rows = torch.repeat_interleave(torch.tensor(list(row_of), dtype=torch.long, device=dev), lengths)
    return rows * vocab + torch.cat(token_ids).long()


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device)[:, None]

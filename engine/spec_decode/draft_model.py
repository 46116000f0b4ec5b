"""The draft-model proposer: a smaller model with the target's tokenizer guesses the next
tokens greedily, on its own paged KV cache.

The draft remembers, per request, the tokens whose KV it holds. Each call keeps the common
prefix of those with the request's new token_ids (the target may have rejected drafts, and
its own accepted or sampled tokens follow), recomputes the rest in one batched forward and
then decodes the drafts one position at a time, all requests in one flat batch per position:

    draft KV (last call):  t0 .. t9  d1 d2 d3          d1..d3: last call's drafts
    token_ids (now):       t0 .. t9  d1 x              target kept d1, then sampled x
    kept (common prefix):  t0 .. t9  d1                (d2, d3: their slots get overwritten)
    one forward:                        x  ─▶ e1       (a new request: its whole prompt)
    decode steps:                       e1 ─▶ e2 ─▶ .. ─▶ en   (KV of e1..e(n-1) written)

The last token of token_ids is always recomputed, even when it is kept: its logits give e1.
Blocks come from a plain free list (no prefix caching: the draft is cheap to recompute).
A request the cache cannot hold gets no drafts, never an error; the target decodes on.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from pdserve.engine.attention.backend import AttentionMetadata
from pdserve.engine.attention.selector import get_attention_backend
from pdserve.engine.config import CacheConfig
from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.model.loader import LoadedModel, load_model, parse_dtype
from pdserve.engine.model.packed_linear import can_prepack
from pdserve.engine.model.source import resolve_model
from pdserve.engine.spec_decode.proposer import DraftRequest, Proposer
from pdserve.engine.worker.kv_cache import allocate_kv_caches, num_kv_blocks

logger = logging.getLogger(__name__)


@dataclass
class _DraftState:
    token_ids: list[int] = field(default_factory=list)  # tokens whose KV the draft cache holds, from position 0
    block_ids: list[int] = field(default_factory=list)


@dataclass
class _Plan:
    """One request's work in this call."""
    req_id: str
    token_ids: list[int]   # the request's tokens; KV of [0, num_kept) is already in the draft cache
    num_kept: int
    num_drafts: int
    block_ids: list[int]

    @property
    def num_new(self) -> int:
        return len(self.token_ids) - self.num_kept


class DraftModelProposer(Proposer):
    def __init__(self, model: str | LoadedModel, num_speculative_tokens: int, device: str,
                 dtype: str | torch.dtype, kv_cache_memory_bytes: int, block_size: int = 16,
                 attention_backend: str = "cpu", *, vocab_limit: int | None = None,
                 max_model_len: int | None = None):
        """`model`: the draft's path or alias, or a model already loaded (tests, a draft that is
        the target itself). `vocab_limit`: drafts are ids below it, the target tokenizer's
        length (a model's vocabulary may be padded past it); None: the draft tokenizer's length.
        `max_model_len` bounds the draft's RoPE tables when it loads the model."""
        _check_positive_int("speculative_config.num_speculative_tokens", num_speculative_tokens)
        _check_positive_int("draft kv_cache_memory_bytes", kv_cache_memory_bytes)
        _check_positive_int("block_size", block_size)
        if attention_backend == "cpu" and torch.device(device).type != "cpu":
            raise ValueError(f"attention_backend: 'cpu' runs on the CPU only, not on device {device!r}")
        dtype = parse_dtype(dtype)
        self.loaded = model if isinstance(model, LoadedModel) else load_model(
            resolve_model(model), dtype, device, max_model_len, progress=False)
        self.model, arch = self.loaded.model, self.loaded.arch
        self.vocab_limit = _resolve_vocab_limit(vocab_limit, len(self.loaded.tokenizer), arch.vocab_size)
        self.num_speculative_tokens = num_speculative_tokens
        self.device, self.block_size = torch.device(device), block_size
        self.max_positions = self.model.rope.max_positions
        if can_prepack(self.device, self.model.dtype):
            self.model.prepack()  # idempotent: a target shared as its own draft is packed already
        self.backend = get_attention_backend(attention_backend)
        cache = CacheConfig(block_size, enable_prefix_caching=False, kv_cache_memory_bytes=kv_cache_memory_bytes)
        self.num_blocks = num_kv_blocks(cache, arch, dtype, self.device)
        self.kv_caches = allocate_kv_caches(self.num_blocks, arch, block_size, dtype, self.device)
        self._free_block_ids = list(range(self.num_blocks - 1, -1, -1))  # a stack: pop() gives 0 first
        self._states: dict[str, _DraftState] = {}
        self._logged_full = False

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids)

    # ---- the contract ------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> dict[str, list[int]]:
        plans = [p for p in map(self._plan, requests) if p is not None]
        if not plans:
            return {}
        # single-token catch-ups first: the attention backend batches them as decodes
        plans.sort(key=lambda p: p.num_new != 1)
        drafts = self._generate(plans)
        out: dict[str, list[int]] = {}
        for plan, row in zip(plans, drafts):
            out[plan.req_id] = row[:plan.num_drafts]
            # the last draft is never fed back, so its KV is not written
            self._states[plan.req_id].token_ids = plan.token_ids + out[plan.req_id][:-1]
        return out

    def finish(self, req_id: str) -> None:
        state = self._states.pop(req_id, None)
        if state is not None:
            self._free_block_ids.extend(reversed(state.block_ids))

    def close(self) -> None:
        for req_id in list(self._states):
            self.finish(req_id)
        self.kv_caches = []

    # ---- planning: what to recompute, how many drafts, which blocks ----------------------
    def _plan(self, req: DraftRequest) -> _Plan | None:
        ids = req.token_ids
        state = self._states.setdefault(req.req_id, _DraftState())
        # keep the common prefix, but always recompute the last token (its logits give draft 1)
        num_kept = min(_common_prefix_len(state.token_ids, ids), len(ids) - 1)
        del state.token_ids[max(num_kept, 0):]
        num_drafts = min(self.num_speculative_tokens, req.max_drafts, self.max_positions - len(ids) + 1)
        if num_kept < 0 or num_drafts < 1 or max(ids[num_kept:]) >= self.model.embed_tokens.num_embeddings:
            return None  # no tokens, past the draft's context, or an id the draft cannot embed
        if not self._fit_blocks(state, len(ids) + num_drafts - 1):
            return None
        return _Plan(req.req_id, ids, num_kept, num_drafts, state.block_ids)

    def _fit_blocks(self, state: _DraftState, num_tokens: int) -> bool:
        """Grow or shrink the request's blocks to hold num_tokens; False when the pool is short."""
        needed = -(-num_tokens // self.block_size)
        extra = needed - len(state.block_ids)
        if extra > len(self._free_block_ids):
            if not self._logged_full:
                logger.warning("draft model KV cache is full (%d blocks): requests it cannot hold get no drafts",
                               self.num_blocks)
                self._logged_full = True
            return False
        if extra > 0:
            state.block_ids.extend(self._free_block_ids.pop() for _ in range(extra))
        elif extra < 0:
            self._free_block_ids.extend(reversed(state.block_ids[needed:]))
            del state.block_ids[needed:]
        return True

    # ---- the forwards -------------------------------------------------------------------
    def _generate(self, plans: list[_Plan]) -> list[list[int]]:
        """Greedy drafts per plan (num_speculative_tokens columns; a row is valid up to its plan's
        num_drafts): one forward over every plan's new tokens, then one per draft position."""
        dev, bs = self.device, self.block_size
        tables = _padded_tables([p.block_ids for p in plans], dev)
        tokens = torch.zeros((len(plans), max(p.num_drafts for p in plans)), dtype=torch.long, device=dev)
        tokens[:, 0] = self._catch_up(plans, tables)
        for i in range(1, tokens.shape[1]):
            rows = [j for j, p in enumerate(plans) if p.num_drafts > i]
            positions = [len(plans[j].token_ids) + i - 1 for j in rows]  # where draft i-1 (0-based) goes
            slots = [plans[j].block_ids[pos // bs] * bs + pos % bs for j, pos in zip(rows, positions)]
            index = torch.tensor(rows, device=dev) if len(rows) < len(plans) else slice(None)
            meta = self._metadata(len(rows), list(range(len(rows) + 1)), [pos + 1 for pos in positions],
                                  tables[index], slots)
            tokens[index, i] = self._greedy(tokens[index, i - 1], positions, meta, torch.arange(len(rows), device=dev))
        return tokens.tolist()

    def _catch_up(self, plans: list[_Plan], tables: torch.Tensor) -> torch.Tensor:
        """One forward over the tokens each plan has not computed yet; the first draft of each."""
        bs = self.block_size
        input_ids, positions, slots, starts = [], [], [], [0]
        for p in plans:
            span = range(p.num_kept, len(p.token_ids))
            input_ids.extend(p.token_ids[p.num_kept:])
            positions.extend(span)
            slots.extend(p.block_ids[pos // bs] * bs + pos % bs for pos in span)
            starts.append(starts[-1] + len(span))
        num_decodes = sum(1 for p in plans if p.num_new == 1)
        meta = self._metadata(num_decodes, starts, [len(p.token_ids) for p in plans], tables, slots)
        last = torch.tensor([s - 1 for s in starts[1:]], dtype=torch.long, device=self.device)
        return self._greedy(torch.tensor(input_ids, dtype=torch.long, device=self.device), positions, meta, last)

    def _metadata(self, num_decodes: int, starts: list[int], seq_lens: list[int], tables: torch.Tensor,
                  slots: list[int]) -> AttentionMetadata:
        dev = self.device
        return AttentionMetadata(
            num_decodes=num_decodes,
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=tables,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            max_query_len=max(b - a for a, b in zip(starts, starts[1:])), max_seq_len=max(seq_lens))

    def _greedy(self, input_ids: torch.Tensor, positions: list[int], meta: AttentionMetadata,
                logits_indices: torch.Tensor) -> torch.Tensor:
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        logits = self.model(input_ids, pos, self.kv_caches, meta, self.backend, logits_indices)
        # ids past the tokenizer (a padded vocabulary) are never proposed
        return logits[:, :self.vocab_limit].argmax(dim=-1)


def check_same_tokenizer(target_tokenizer, draft_tokenizer) -> None:
    """A draft must speak the target's token ids; raises naming the config field otherwise."""
    if len(target_tokenizer) != len(draft_tokenizer) or target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        raise InvalidRequestError("speculative_config.model", "the draft model's tokenizer differs from the "
                                  f"target's ({len(draft_tokenizer)} vs {len(target_tokenizer)} tokens)")


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case, compared in C
        return n
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _padded_tables(block_ids: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max(len(t) for t in block_ids)
    return torch.tensor([t + [0] * (width - len(t)) for t in block_ids], dtype=torch.int32, device=device)


def _resolve_vocab_limit(vocab_limit: int | None, tokenizer_len: int, vocab_size: int) -> int:
    if vocab_limit is None:
        return min(tokenizer_len, vocab_size)
    if isinstance(vocab_limit, bool) or not isinstance(vocab_limit, int) or not 1 <= vocab_limit <= vocab_size:
        raise ValueError(f"vocab_limit: must be an integer in [1, {vocab_size}] (the draft's vocabulary), "
                         f"got {vocab_limit!r}")
    return vocab_limit


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")

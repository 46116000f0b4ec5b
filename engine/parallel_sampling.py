"""Parallel sampling (SamplingParams.n > 1), as vLLM v1: one request the caller adds runs as
n requests of the engine that share the prompt, and the caller gets n outputs under its
own req_id, told apart by RequestOutput.index.

    added:   req_id "r", n = 3, seed s
    engine:  "r"    index 0, seed s       computes the prompt
             "r#1"  index 1, seed s + 1   admitted once "r" has allocated the prompt's full
             "r#2"  index 2, seed s + 2   blocks: hits them in the prefix cache

    prompt   [ block 0 ][ block 1 ][tail]
    "r"      [ computed ...................]
    "r#1"    [ hit     ][ hit     ][comp.]   the last prompt token is always computed, so a
                                             sibling computes at most one block of the prompt

Without prefix caching each sibling computes the whole prompt (nothing to wait for). The
full blocks are shared by reference count, never copied; the partial last block is
recomputed by each sibling (as vLLM v1, which relies on prefix caching too): at most
block_size tokens against a copy-on-write the kernels would need to support. A block a
sibling hits may be written in that very step: the cache manager registers a block when it
allocates it, which is safe because every layer writes a step's KV before any attention
reads it (KVCacheManager.allocate_slots), and the first sibling always precedes the others
in the step's batch (admitted first), so also in its pipeline micro-batches.

Seeds (vLLM's rule): completion i of a seeded request uses seed + i, so its tokens are
exactly those of a single request with that seed (a seeded draw depends only on the seed
and the position: engine/sample/sampler.py); unseeded completions draw independently;
greedy ones are all the same.

A prefill-only request (a prefill worker's) hands off each completion after its own first
token; the first to hand off carries the prompt's KV (kv_export), its siblings none: they
share that prompt.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

from pdserve.engine.engine_request import EngineRequest
from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.request import FamilyMember, Request, RequestMode, RequestStatus
from pdserve.engine.sampling_params import SamplingParams


def child_req_id(req_id: str, index: int) -> str:
    """The engine's name for completion `index`; the first keeps the request's own."""
    return req_id if index == 0 else f"{req_id}#{index}"


def child_params(params: SamplingParams) -> list[SamplingParams]:
    """One SamplingParams per completion, each with n = 1 (the same object when n is 1)."""
    if params.n == 1:
        return [params]
    children = []
    for index in range(params.n):
        child = copy.copy(params)  # validated already; copy keeps resolved bad words
        child.n = 1
        if params.seed is not None:
            child.seed = params.seed + index
        children.append(child)
    return children


def family_requests(new: EngineRequest, eos_token_ids: frozenset[int]) -> list[Request]:
    """The engine's requests for `new`: its n completions sharing the prompt, the first first
    (it alone imports the KV it was given); just one for n = 1."""
    return [Request(dataclasses.replace(new, req_id=child_req_id(new.req_id, index), params=child,
                                        kv_import=new.kv_import if index == 0 else None),
                    eos_token_ids, FamilyMember(index, new.req_id))
            for index, child in enumerate(child_params(new.params))]


def validate_fork(req_id: str, params: SamplingParams, mode: RequestMode, num_output_tokens: int,
                  active_req_ids) -> None:
    """n > 1 forks a prompt: a request that continues a completion (decode-only, or one
    resumed with output tokens) has exactly one."""
    if params.n == 1:
        return
    if mode == RequestMode.DECODE_ONLY or num_output_tokens:
        raise InvalidRequestError("n", f"must be 1 for a request that continues a completion, got {params.n}")
    taken = [child_req_id(req_id, i) for i in range(1, params.n) if child_req_id(req_id, i) in active_req_ids]
    if taken:
        raise InvalidRequestError("req_id", f"{taken[0]!r} (a completion of {req_id!r}) is already in the engine")


def waits_for_sibling(request: Request, first: Request | None, block_size: int) -> bool:
    """Whether a sibling (index > 0) should stay queued: its first sibling is running and
    has not yet allocated the prompt's full blocks, which this one would otherwise compute
    again (each prefill chunk of the first registers its full blocks at allocation)."""
    if request.family.index == 0 or first is None or first.status != RequestStatus.RUNNING:
        return False  # the first is queued behind it (preempted after it), or gone: compute
    if request.skip_reading_prefix_cache:
        return False
    num_shared = (request.num_prompt_tokens - 1) // block_size * block_size
    return first.num_computed_tokens < num_shared


@dataclass
class _Family:
    n: int
    num_open: int
    kv_exported: bool = False


class Families:
    """The requests added with n > 1 whose completions are not all finished."""

    def __init__(self) -> None:
        self._families: dict[str, _Family] = {}

    def add(self, req_id: str, n: int) -> None:
        if n > 1:
            self._families[req_id] = _Family(n, n)

    def req_ids(self, req_id: str) -> list[str]:
        """The engine's ids of every completion of `req_id` (just it for n = 1 or unknown)."""
        family = self._families.get(req_id)
        return [child_req_id(req_id, i) for i in range(family.n if family is not None else 1)]

    def takes_kv_export(self, request: Request) -> bool:
        """At a hand-off: whether this completion exports the prompt's KV (the first to hand off)."""
        family = self._families.get(request.family.parent_req_id)
        if family is None:
            return True
        exported, family.kv_exported = family.kv_exported, True
        return not exported

    def finished(self, request: Request) -> None:
        """A completion's final output is out; the family is forgotten with its last."""
        family = self._families.get(request.family.parent_req_id)
        if family is not None:
            family.num_open -= 1
            if family.num_open == 0:
                del self._families[request.family.parent_req_id]

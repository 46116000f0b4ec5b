"""The requests a run sends: random prompts with length distributions, prompts sharing
a system prompt, a Mooncake-format JSONL trace, or a ShareGPT-format JSON file; and
multi-turn chat conversations (`chat_conversations`), driven turn by turn by their caller.

Prompts are token ids where the dataset makes them (sent as ids, so their lengths are
exact), text for ShareGPT. Everything is deterministic given the seed."""
from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

DISTRIBUTIONS = ("fixed", "uniform", "lognormal")
DATASETS = ("random", "shared-prefix", "mooncake", "sharegpt")
FIRST_TOKEN_ID = 100  # random prompts avoid the low ids, where special tokens usually live


@dataclass(frozen=True)
class LengthDist:
    """`mean` tokens; uniform: mean ± spread*mean; lognormal: median `mean`, sigma `spread`.
    Every draw is clamped to [lo, hi]."""
    mean: int
    kind: str = "fixed"
    spread: float = 0.0
    lo: int = 1
    hi: int = 1 << 20

    def __post_init__(self):
        if self.kind not in DISTRIBUTIONS:
            raise ValueError(f"length distribution: {self.kind!r} is not one of {', '.join(DISTRIBUTIONS)}")
        if self.mean < 0 or self.spread < 0 or self.lo > self.hi:
            raise ValueError(f"length distribution: bad parameters {self}")

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        if self.kind == "fixed" or self.spread == 0:
            values = np.full(n, float(self.mean))
        elif self.kind == "uniform":
            width = self.spread * self.mean
            values = rng.uniform(self.mean - width, self.mean + width, n)
        else:
            values = rng.lognormal(math.log(max(self.mean, 1)), self.spread, n)
        return [int(v) for v in np.clip(np.rint(values), self.lo, self.hi)]


@dataclass(frozen=True)
class DatasetConfig:
    name: str = "random"
    num_requests: int = 100
    input_len: LengthDist = LengthDist(128)
    output_len: LengthDist = LengthDist(64)
    prefix_len: int = 0          # shared-prefix: the system prompt's tokens
    num_prefixes: int = 1        # shared-prefix: distinct system prompts, requests spread over them
    prefix_seed: int | None = None  # shared-prefix: draws the system prompts (default: seed)
    path: str | None = None      # mooncake / sharegpt file
    trace_block_size: int = 512  # mooncake: tokens per hash id
    sharegpt_output_len: int | None = None  # sharegpt: fixed output length instead of the reply's
    vocab_size: int = 32000
    seed: int = 0

    def __post_init__(self):
        if self.name not in DATASETS:
            raise ValueError(f"dataset: {self.name!r} is not one of {', '.join(DATASETS)}")
        if self.name in ("mooncake", "sharegpt") and not self.path:
            raise ValueError(f"dataset {self.name}: needs a file (--dataset-path)")
        if self.num_requests < 1:
            raise ValueError("dataset: needs at least one request")
        if self.vocab_size <= FIRST_TOKEN_ID + 1:
            raise ValueError(f"dataset: vocab size {self.vocab_size} too small")


@dataclass(frozen=True)
class BenchRequest:
    prompt: tuple[int, ...] | str
    prompt_len: int | None      # None: a text prompt without a tokenizer (the server's usage tells)
    output_len: int
    arrival_s: float | None = None  # a trace's own arrival time, relative to its first request


def _random_ids(rng: np.random.Generator, vocab_size: int, n: int) -> tuple[int, ...]:
    return tuple(int(t) for t in rng.integers(FIRST_TOKEN_ID, vocab_size, n))


def random_requests(cfg: DatasetConfig) -> list[BenchRequest]:
    rng = np.random.default_rng(cfg.seed)
    ins, outs = cfg.input_len.sample(rng, cfg.num_requests), cfg.output_len.sample(rng, cfg.num_requests)
    return [BenchRequest(_random_ids(rng, cfg.vocab_size, i), i, o) for i, o in zip(ins, outs)]


def shared_prefix_requests(cfg: DatasetConfig) -> list[BenchRequest]:
    """Request k: system prompt k % num_prefixes (prefix_len tokens), then its own
    input_len tokens."""
    rng = np.random.default_rng(cfg.seed)
    prefix_rng = np.random.default_rng([cfg.seed if cfg.prefix_seed is None else cfg.prefix_seed, 1])
    prefixes = [_random_ids(prefix_rng, cfg.vocab_size, cfg.prefix_len) for _ in range(max(cfg.num_prefixes, 1))]
    ins, outs = cfg.input_len.sample(rng, cfg.num_requests), cfg.output_len.sample(rng, cfg.num_requests)
    out = []
    for k, (i, o) in enumerate(zip(ins, outs)):
        prompt = prefixes[k % len(prefixes)] + _random_ids(rng, cfg.vocab_size, i)
        out.append(BenchRequest(prompt, len(prompt), o))
    return out


def _block_tokens(hash_id: int, size: int, vocab_size: int, seed: int) -> tuple[int, ...]:
    return _random_ids(np.random.default_rng([seed, int(hash_id)]), vocab_size, size)


def mooncake_requests(cfg: DatasetConfig, lines) -> list[BenchRequest]:
    """Mooncake trace lines: {"timestamp": ms, "input_length", "output_length",
    "hash_ids": [...]}. Each hash id stands for one block of `trace_block_size` tokens, the
    same tokens wherever it appears, so requests sharing hash ids share a prefix. The first
    `num_requests` records, arrival times relative to the first."""
    rng = np.random.default_rng(cfg.seed)
    out, t0 = [], None
    for lineno, line in enumerate(lines, 1):
        if len(out) >= cfg.num_requests:
            break
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            ts, n_in, n_out = float(rec["timestamp"]), int(rec["input_length"]), int(rec["output_length"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"trace line {lineno}: {e!r}") from None
        if n_in < 1 or n_out < 1:
            raise ValueError(f"trace line {lineno}: lengths must be positive")
        t0 = ts if t0 is None else t0
        prompt: tuple[int, ...] = ()
        for h in rec.get("hash_ids") or []:
            if len(prompt) >= n_in:
                break
            prompt += _block_tokens(h, cfg.trace_block_size, cfg.vocab_size, cfg.seed)
        prompt = prompt[:n_in] + _random_ids(rng, cfg.vocab_size, n_in - len(prompt[:n_in]))
        out.append(BenchRequest(prompt, n_in, n_out, arrival_s=(ts - t0) / 1000.0))
    if not out:
        raise ValueError("trace: no requests")
    return out


def sharegpt_requests(cfg: DatasetConfig, data, tokenize: Callable[[str], list[int]] | None = None
                      ) -> list[BenchRequest]:
    """ShareGPT JSON: [{"conversations": [{"from": "human", "value": ...}, {"from": "gpt",
    "value": ...}, ...]}, ...]. The first human turn is the prompt, the reply that follows
    sets the output length (counted with `tokenize`, else ~4 characters a token) unless
    `sharegpt_output_len` fixes it. Conversations without such a pair are skipped."""
    out = []
    for item in data:
        if len(out) >= cfg.num_requests:
            break
        turns = (item.get("conversations") or item.get("conversation") or []) if isinstance(item, dict) else []
        pair = None
        for a, b in zip(turns, turns[1:]):
            if a.get("from") in ("human", "user") and b.get("from") in ("gpt", "assistant", "chatgpt"):
                pair = (str(a.get("value", "")), str(b.get("value", "")))
                break
        if pair is None or not pair[0]:
            continue
        prompt, reply = pair
        if cfg.sharegpt_output_len is not None:
            n_out = cfg.sharegpt_output_len
        else:
            n_out = len(tokenize(reply)) if tokenize else math.ceil(len(reply) / 4)
        n_in = len(tokenize(prompt)) if tokenize else None
        out.append(BenchRequest(prompt, n_in, max(1, min(n_out, cfg.output_len.hi))))
    if not out:
        raise ValueError("sharegpt: no conversation with a human turn followed by a reply")
    return out


@dataclass(frozen=True)
class ChatConfig:
    """Multi-turn chats: every conversation opens with the same system prompt; each turn
    appends a user message to everything before it (the previous answers included)."""
    num_conversations: int = 8
    num_turns: int = 4
    system_len: int = 512                  # tokens of the shared system prompt
    user_len: LengthDist = LengthDist(64, "uniform", 0.5, lo=1)
    output_len: LengthDist = LengthDist(32)
    vocab_size: int = 32000
    seed: int = 0
    # ChatML's message markers (SmolLM2's <|im_start|>, <|im_end|>): every message is
    # framed by the same template tokens, as in a real chat
    im_start: int = 1
    im_end: int = 2

    def __post_init__(self):
        if self.num_conversations < 1 or self.num_turns < 1 or self.system_len < 0:
            raise ValueError(f"chat: bad parameters {self}")


@dataclass(frozen=True)
class ChatConversation:
    system: tuple[int, ...]                 # the framed system message
    user_turns: tuple[tuple[int, ...], ...]  # each framed user message, with the assistant's header
    output_lens: tuple[int, ...]

    def prompt(self, history: tuple[int, ...], turn: int) -> tuple[int, ...]:
        """Turn `turn`'s prompt: the conversation so far (`history`, () before the first
        turn: the system message) and this turn's user message.

            turn 0   [system][user 0][assistant header]
            turn 1   [system][user 0][assistant header][answer 0 end][user 1][assistant header]
        """
        return (history or self.system) + self.user_turns[turn]


def chat_conversations(cfg: ChatConfig) -> list[ChatConversation]:
    rng = np.random.default_rng(cfg.seed)
    system = (cfg.im_start,) + _random_ids(rng, cfg.vocab_size, cfg.system_len) + (cfg.im_end,)
    assistant = (cfg.im_start, FIRST_TOKEN_ID)  # "<|im_start|>assistant\n": one fixed token for the role
    out = []
    for _ in range(cfg.num_conversations):
        lens = cfg.user_len.sample(rng, cfg.num_turns)
        users = tuple((cfg.im_start,) + _random_ids(rng, cfg.vocab_size, n) + (cfg.im_end,) + assistant for n in lens)
        out.append(ChatConversation(system, users, tuple(cfg.output_len.sample(rng, cfg.num_turns))))
    return out


def chat_history(prompt: tuple[int, ...], answer_ids: list[int], im_end: int = 2) -> tuple[int, ...]:
    """The conversation after a turn: its prompt, the assistant's answer (the tokens it
    really generated, so the cache that holds them can be reused) and the end marker."""
    return prompt + tuple(answer_ids) + (im_end,)


def load_requests(cfg: DatasetConfig, tokenize: Callable[[str], list[int]] | None = None) -> list[BenchRequest]:
    if cfg.name == "random":
        return random_requests(cfg)
    if cfg.name == "shared-prefix":
        return shared_prefix_requests(cfg)
    with open(cfg.path, encoding="utf-8") as f:
        if cfg.name == "mooncake":
            return mooncake_requests(cfg, f)
        return sharegpt_requests(cfg, json.load(f), tokenize)

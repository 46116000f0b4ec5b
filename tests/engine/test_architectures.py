"""Every supported architecture token-exact with transformers on a tiny random checkpoint
(bench/tiny_checkpoints.py: 3 layers, GQA, a 24-token window where the architecture has
one, prompts to 3x the window): offline, chunked in chunks smaller than the window,
prefix-cached, preempted, handed off as KV from a prefill engine to a decode engine, and
at TP = 2. Logprobs agree with transformers' within 1e-4 (float32)."""
from __future__ import annotations

import pytest
import torch

from bench.tiny_checkpoints import ARCHITECTURES, WINDOW, build_tiny_checkpoint
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.engine_request import EngineRequest
from pdserve.engine.model.loader import load_model
from pdserve.engine.model.source import resolve_model
from pdserve.engine.request import RequestMode
from tests.engine.correctness import run_to_completion, varied_prompts
from tests.engine.hf_reference import load_hf_model
from tests.models import smollm2_tokenizer

MAX_TOKENS = 10
LENGTHS = [5, 30, 3 * WINDOW + 3]
WINDOWED = {"mistral", "qwen3", "gemma2", "gemma3", "phi3"}


def _greedy(logprobs: bool = False) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0 if logprobs else None)


@torch.inference_mode()
def _hf_reference(model, prompts, eos) -> tuple[list[list[int]], list[list[float]]]:
    tokens, logprobs = [], []
    for ids in prompts:
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=sorted(eos),
                             pad_token_id=sorted(eos)[0], output_logits=True, return_dict_in_generate=True)
        new = out.sequences[0, len(ids):].tolist()
        steps = [torch.log_softmax(step[0].float(), -1) for step in out.logits]
        tokens.append(new)
        logprobs.append([float(steps[i][t]) for i, t in enumerate(new)])
    return tokens, logprobs


class Case:
    def __init__(self, name: str, path: str):
        self.name, self.path = name, path
        self.loaded = load_model(resolve_model(path), torch.float32, "cpu", progress=False)
        self.prompts = varied_prompts(self.loaded.arch.vocab_size, LENGTHS, seed=3)
        hf = load_hf_model(path)
        self.expected, self.expected_logprobs = _hf_reference(hf, self.prompts, self.loaded.eos_token_ids)
        self.hf = hf

    def llm(self, **kwargs) -> LLM:
        return LLM(self.path, loaded_model=self.loaded, progress=False, **kwargs)

    def generate(self, llm: LLM, logprobs: bool = False):
        return llm.generate([{"prompt_token_ids": p} for p in self.prompts], _greedy(logprobs))


@pytest.fixture(scope="module", params=ARCHITECTURES)
def case(request, tmp_path_factory) -> Case:
    path = build_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param), smollm2_tokenizer())
    return Case(request.param, path)


def _all_blocks_free(llm: LLM) -> bool:
    kv = llm.engine.kv_manager
    return kv.num_free_blocks == kv.pool.num_blocks


def test_offline_greedy_and_logprobs(case):
    outs = case.generate(case.llm(), logprobs=True)
    assert [o.token_ids for o in outs] == case.expected
    for out, expected in zip(outs, case.expected_logprobs):
        assert [lp.logprob for lp in out.logprobs] == pytest.approx(expected, abs=1e-4)


def test_window_changes_the_reference(case):
    """The prompts pass the window: transformers itself answers differently without it,
    so the tests above would catch an ignored window."""
    if case.name not in WINDOWED:
        assert not case.loaded.arch.layer_windows
        return
    assert any(w == WINDOW for w in case.loaded.arch.layer_windows)
    cfg = case.hf.config
    saved = cfg.sliding_window
    try:
        cfg.sliding_window = 10 ** 6  # as good as none at these lengths, same code path
        for layer in case.hf.model.layers:
            if getattr(layer.self_attn, "sliding_window", None):
                layer.self_attn.sliding_window = 10 ** 6
        unwindowed, _ = _hf_reference(case.hf, case.prompts, case.loaded.eos_token_ids)
    finally:
        cfg.sliding_window = saved
        for layer in case.hf.model.layers:
            if getattr(layer.self_attn, "sliding_window", None):
                layer.self_attn.sliding_window = saved
    assert unwindowed != case.expected


def test_chunks_smaller_than_the_window(case):
    llm = case.llm(long_prefill_token_threshold=7, max_num_batched_tokens=40)
    assert [o.token_ids for o in case.generate(llm)] == case.expected
    assert _all_blocks_free(llm)


def test_prefix_cached(case):
    llm = case.llm()
    case.generate(llm)
    before = llm.engine.kv_manager.num_hit_tokens
    again = case.generate(llm)
    assert [o.token_ids for o in again] == case.expected
    assert llm.engine.kv_manager.num_hit_tokens - before >= 16 * (LENGTHS[-1] // 16)


def test_preempted(case):
    llm = case.llm(kv_cache_memory_bytes=7 * _block_bytes(case), long_prefill_token_threshold=16)
    assert [o.token_ids for o in case.generate(llm)] == case.expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert _all_blocks_free(llm)


def _block_bytes(case) -> int:
    arch = case.loaded.arch
    return 2 * arch.num_layers * 16 * arch.num_kv_heads * arch.head_dim * 4


def test_kv_handed_off_from_prefill_to_decode(case):
    """The P/D path: the prefill engine's exported KV (what the kvstore carries) continues
    in another engine."""
    prefill, decode = case.llm().engine, case.llm().engine
    params = _greedy()
    prefilled = run_to_completion(prefill, [(f"p{i}", p, params, {"mode": RequestMode.PREFILL_ONLY})
                                            for i, p in enumerate(case.prompts)])
    requests = [(f"d{i}", p, params, {"mode": RequestMode.DECODE_ONLY, "output_token_ids": prefilled[f"p{i}"].token_ids,
                                      "kv_import": prefilled[f"p{i}"].kv_export})
                for i, p in enumerate(case.prompts)]
    decoded = run_to_completion(decode, requests)
    assert [decoded[f"d{i}"].token_ids for i in range(len(case.prompts))] == case.expected
    assert all(prefilled[f"p{i}"].finish_reason == "handoff" for i in range(len(case.prompts)))


def test_tensor_parallel_2(case):
    llm = LLM(case.path, tensor_parallel_size=2, progress=False, kv_cache_memory_bytes=1 << 24,
              long_prefill_token_threshold=16, collective_timeout_s=60)
    try:
        assert [o.token_ids for o in case.generate(llm)] == case.expected
    finally:
        llm.engine.shutdown()


def test_speculative_decoding(case):
    """ngram drafts verified through the windowed (and soft-capped) attention."""
    llm = case.llm(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert [o.token_ids for o in case.generate(llm)] == case.expected
    assert llm.engine.stats().spec.num_proposed_tokens > 0
    assert _all_blocks_free(llm)


@pytest.mark.parametrize("case", ["mistral"], indirect=True)  # every layer windowed
def test_blocks_outside_every_window_are_freed(case):
    """A request past 3x the window holds only the blocks its window can still see: at most
    ceil(W / 16) + 1 (3 here), while its whole context takes 8."""
    engine = case.llm(long_prefill_token_threshold=16).engine
    prompt = case.prompts[2]
    assert len(prompt) >= 3 * WINDOW
    engine.add_request(EngineRequest("long", prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)))
    held = []
    while engine.has_unfinished_requests():
        engine.step()
        held.append(engine.kv_manager.pool.num_blocks - engine.kv_manager.num_free_blocks)
    context = len(prompt) + 40 - 1  # the last sampled token is never written
    assert -(-context // 16) == 8
    assert max(held) == -(-WINDOW // 16) + 1 == 3
    assert held[-1] == 0 and engine.kv_manager.num_windowed_out_blocks >= 8 - 4

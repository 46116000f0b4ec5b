import json

import numpy as np
import pytest

from pdserve.cli.bench.datasets import (FIRST_TOKEN_ID, DatasetConfig, LengthDist, load_requests, mooncake_requests,
                                        random_requests, sharegpt_requests, shared_prefix_requests)


def test_length_distributions():
    rng = np.random.default_rng(0)
    assert LengthDist(7).sample(rng, 5) == [7] * 5
    u = LengthDist(100, "uniform", 0.5).sample(rng, 5000)
    assert min(u) >= 50 and max(u) <= 150 and np.mean(u) == pytest.approx(100, rel=0.02)
    ln = LengthDist(100, "lognormal", 0.5).sample(rng, 5000)
    assert np.median(ln) == pytest.approx(100, rel=0.05) and np.mean(ln) > np.median(ln)
    assert min(LengthDist(10, "lognormal", 2.0, lo=3, hi=20).sample(rng, 2000)) >= 3
    assert max(LengthDist(10, "lognormal", 2.0, lo=3, hi=20).sample(rng, 2000)) <= 20
    with pytest.raises(ValueError):
        LengthDist(10, "normal")


def test_random_requests_are_exact_and_seeded():
    cfg = DatasetConfig(num_requests=20, input_len=LengthDist(50, "uniform", 0.4),
                        output_len=LengthDist(8, "uniform", 0.5), vocab_size=1000, seed=5)
    reqs = random_requests(cfg)
    assert len(reqs) == 20
    for r in reqs:
        assert len(r.prompt) == r.prompt_len and 30 <= r.prompt_len <= 70 and 4 <= r.output_len <= 12
        assert all(FIRST_TOKEN_ID <= t < 1000 for t in r.prompt)
    assert reqs == random_requests(cfg)


def test_shared_prefix():
    cfg = DatasetConfig("shared-prefix", num_requests=6, input_len=LengthDist(5), output_len=LengthDist(3),
                        prefix_len=40, num_prefixes=2, vocab_size=5000)
    reqs = shared_prefix_requests(cfg)
    assert all(r.prompt_len == 45 == len(r.prompt) for r in reqs)
    a, b = reqs[0].prompt[:40], reqs[1].prompt[:40]
    assert a != b
    assert [r.prompt[:40] for r in reqs] == [a, b, a, b, a, b]
    assert len({r.prompt[40:] for r in reqs}) == 6
    other = shared_prefix_requests(DatasetConfig("shared-prefix", num_requests=2, input_len=LengthDist(5),
                                                 prefix_len=40, num_prefixes=2, vocab_size=5000, seed=9,
                                                 prefix_seed=0))
    assert [r.prompt[:40] for r in other] == [a, b] and other[0].prompt[40:] != reqs[0].prompt[40:]


def test_mooncake_trace(tmp_path):
    lines = [
        {"timestamp": 1000, "input_length": 10, "output_length": 3, "hash_ids": [7, 8]},
        {"timestamp": 1500, "input_length": 6, "output_length": 2, "hash_ids": [7]},
        {"timestamp": 4000, "input_length": 9, "output_length": 5},
        {"timestamp": 5000, "input_length": 9, "output_length": 5},
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    cfg = DatasetConfig("mooncake", num_requests=3, path=str(path), trace_block_size=4, vocab_size=5000)
    reqs = load_requests(cfg)
    assert [r.arrival_s for r in reqs] == [0.0, 0.5, 3.0]
    assert [(len(r.prompt), r.prompt_len, r.output_len) for r in reqs] == [(10, 10, 3), (6, 6, 2), (9, 9, 5)]
    assert reqs[0].prompt[:4] == reqs[1].prompt[:4]  # hash id 7: the same block
    assert reqs[0].prompt[4:8] != reqs[1].prompt[4:8]
    with pytest.raises(ValueError, match="line 1"):
        mooncake_requests(cfg, ['{"timestamp": 1}'])


def test_sharegpt():
    data = [
        {"id": "a", "conversations": [{"from": "human", "value": "hello there"},
                                      {"from": "gpt", "value": "general kenobi, you are bold"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "only a reply"}]},
        {"id": "c", "conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "q"},
                                      {"from": "gpt", "value": "abcdefghi"}]},
        "not a conversation",
    ]
    words = lambda s: s.split()  # noqa: E731
    cfg = DatasetConfig("sharegpt", num_requests=10, path="x.json")
    reqs = sharegpt_requests(cfg, data, words)
    assert [(r.prompt, r.prompt_len, r.output_len) for r in reqs] == [("hello there", 2, 5), ("q", 1, 1)]
    no_tok = sharegpt_requests(cfg, data)
    assert [(r.prompt_len, r.output_len) for r in no_tok] == [(None, 7), (None, 3)]  # ~4 characters a token
    fixed = sharegpt_requests(DatasetConfig("sharegpt", num_requests=1, path="x", sharegpt_output_len=9), data)
    assert [(r.prompt, r.output_len) for r in fixed] == [("hello there", 9)]
    with pytest.raises(ValueError):
        sharegpt_requests(cfg, [data[1]])


def test_chat_conversations_share_the_system_prompt_and_grow_by_appending():
    from pdserve.cli.bench.datasets import ChatConfig, chat_conversations, chat_history
    cfg = ChatConfig(num_conversations=3, num_turns=2, system_len=20, user_len=LengthDist(8), output_len=LengthDist(5))
    convs = chat_conversations(cfg)
    assert chat_conversations(cfg) == convs  # seeded
    assert len({c.system for c in convs}) == 1 and len(convs[0].system) == 22  # framed by im_start / im_end
    first = convs[0].prompt((), 0)
    assert first[:22] == convs[0].system and first[-2:] == (cfg.im_start, FIRST_TOKEN_ID)  # the assistant header
    second = convs[0].prompt(chat_history(first, [7, 8, 9]), 1)
    assert second[:len(first)] == first and second[len(first):len(first) + 4] == (7, 8, 9, cfg.im_end)
    assert convs[0].user_turns != convs[1].user_turns and convs[0].output_lens == (5, 5)

"""prompt_logprobs through Router.Generate: computed by whichever worker computes the prompt
(the prefill worker; the decode worker on the direct path), sent once with the first token,
never from a cached prefix (local or the kvstore's), equal to the offline engine's."""
from __future__ import annotations

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.services.router.client import RouterClient
from tests.services.test_disaggregated import LONG, SHORT, _tokens, cluster  # noqa: F401 (the fixture)

TOP = 2


def _params(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=6, **kw)


def _as_engine(msg_prompt_logprobs) -> list:
    """The wire's PromptLogprobs as comparable tuples: (token, logprob, rank, {top id: logprob})."""
    return [(lp.token_id, lp.logprob, rank, dict(lp.top_logprobs))
            for lp, rank in zip(msg_prompt_logprobs.tokens, msg_prompt_logprobs.ranks)]


def _expected(out) -> list:
    rows = []
    for token_id, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        top = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:TOP]
        rows.append((token_id, entry[token_id].logprob, entry[token_id].rank, {t: lp.logprob for t, lp in top}))
    return rows


def _assert_same(got: list, want: list) -> None:
    assert [g[0] for g in got] == [w[0] for w in want] and [g[2] for g in got] == [w[2] for w in want]
    for g, w in zip(got, want):
        assert g[1] == pytest.approx(w[1], abs=1e-5) and g[3].keys() == w[3].keys()
        assert list(g[3].values()) == pytest.approx([w[3][t] for t in g[3]], abs=1e-5)


@pytest.mark.parametrize("prompt,path", [(SHORT[1], "direct"), (LONG[0], "disaggregated")])
def test_prompt_logprobs_come_once_with_the_first_token(cluster, tiny, tiny_llama_dir, prompt, path):  # noqa: F811
    llm = LLM(tiny_llama_dir, loaded_model=tiny, progress=False)
    want = llm.generate({"prompt_token_ids": prompt}, _params(prompt_logprobs=TOP))[0]
    for attempt in range(2):  # the second time the prompt is cached (locally and in the kvstore)
        with RouterClient(cluster.router.address) as client:
            msgs = list(client.generate(prompt, _params(prompt_logprobs=TOP)))
        assert msgs[-1].path == path and _tokens(msgs) == want.token_ids
        assert msgs[0].HasField("prompt_logprobs") and not any(m.HasField("prompt_logprobs") for m in msgs[1:])
        assert len(msgs[0].prompt_logprobs.tokens) == len(prompt) - 1
        _assert_same(_as_engine(msgs[0].prompt_logprobs), _expected(want))
        assert msgs[-1].usage.cached_prompt_tokens == 0  # every prompt token computed, each time
    # the prompt's blocks were still cached (and written) for requests without prompt_logprobs
    with RouterClient(cluster.router.address) as client:
        plain = list(client.generate(prompt, _params()))
    assert not plain[0].HasField("prompt_logprobs") and _tokens(plain) == want.token_ids
    assert plain[-1].usage.cached_prompt_tokens > 0


def test_the_prefill_worker_computes_them_and_the_decode_worker_does_not(cluster):  # noqa: F811
    prefill, decode = cluster.prefills[0].servicer.metrics, cluster.decodes[0].servicer.metrics
    before = prefill.prompt_tokens._value.get(), decode.prompt_tokens._value.get()
    with RouterClient(cluster.router.address) as client:
        msgs = list(client.generate(LONG[1], _params(prompt_logprobs=0)))
    assert msgs[-1].path == "disaggregated"
    assert prefill.prompt_tokens._value.get() - before[0] == len(LONG[1])
    assert decode.prompt_tokens._value.get() == before[1]  # it continued the prefill's KV
    assert [lp.top_logprobs for lp in msgs[0].prompt_logprobs.tokens] == [{}] * (len(LONG[1]) - 1)

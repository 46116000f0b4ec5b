"""--speculative-config on the workers: parsed by the engine's SpeculativeConfig (a bad one
refused naming the field), acted on by decode workers, dropped by prefill workers; and the
speculative decoding counters a decode worker serves on /metrics."""
from __future__ import annotations

import argparse
import logging
import time
import urllib.request

import pytest

from pdserve.engine.spec_decode.proposer import NoProposer
from prometheus_client.parser import text_string_to_metric_families

from pdserve.engine.config import EngineConfig
from pdserve.engine.spec_decode.config import SpeculativeConfig
from pdserve.services.common.grpc_server import channel
from pdserve.services.decode.server import serve as serve_decode
from pdserve.services.pb import common_pb2, decode_pb2, decode_pb2_grpc
from pdserve.services.prefill.server import serve as serve_prefill
from pdserve.services.worker.config import WorkerConfig, add_worker_arguments, worker_config_from_args

NGRAM = SpeculativeConfig("ngram", 4, prompt_lookup_min=1, prompt_lookup_max=4)
SPEC = "pdserve_worker_spec_"


def _config(*argv: str, role: str = "decode"):
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser, default_port=0, role=role)
    return worker_config_from_args(parser.parse_args(list(argv)))


def test_off_by_default_and_off_for_an_empty_object():
    assert _config().engine.speculative_config is None
    assert _config("--speculative-config", "{}").engine.speculative_config is None


def test_the_json_reaches_the_engine_config():
    cfg = _config("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4, '
                                          '"prompt_lookup_min": 1, "prompt_lookup_max": 4}')
    assert cfg.engine.speculative_config == NGRAM
    cfg = _config("--speculative-config", '{"method": "draft_model", "model": "smollm2", '
                                          '"num_speculative_tokens": 3, "disable_by_batch_size": 8}')
    assert cfg.engine.speculative_config == SpeculativeConfig("draft_model", 3, model="smollm2",
                                                              disable_by_batch_size=8)


@pytest.mark.parametrize("text,field", [
    ('{"method": "ngram", ', "speculative_config: not valid JSON"),
    ('[1, 2]', "speculative_config: must be a dict"),
    ('{"method": "ngram", "num_speculative_tokens": 4, "lookahead": 2}', "speculative_config.lookahead"),
    ('{"method": "eagle", "num_speculative_tokens": 4}', "speculative_config.method"),
    ('{"method": "ngram"}', "speculative_config.num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": "4"}', "speculative_config.num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 5}',
     "speculative_config.prompt_lookup_min"),
    ('{"method": "draft_model", "num_speculative_tokens": 3}', "speculative_config.model"),
])
def test_a_bad_config_exits_naming_the_flag_and_the_field(text, field, capsys):
    with pytest.raises(SystemExit) as e:
        _config("--speculative-config", text)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --speculative-config: " + field in err, err


def test_the_help_says_prefill_workers_ignore_it(capsys):
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser, default_port=0, role="prefill")
    parser.print_help()
    assert "IGNORED: prefill workers do not speculate" in " ".join(capsys.readouterr().out.split())


def _engine(model: str, spec: SpeculativeConfig) -> EngineConfig:
    from pdserve.engine.config import CacheConfig
    return EngineConfig(model=model, cache=CacheConfig(kv_cache_memory_bytes=8 << 20), speculative_config=spec)


def test_a_prefill_worker_drops_it_and_says_so(tiny_llama_dir, tiny, caplog):
    with caplog.at_level(logging.WARNING):
        worker = serve_prefill(WorkerConfig(engine=_engine(tiny_llama_dir, NGRAM), kvstore_address="127.0.0.1:1"),
                               tiny)
    try:
        assert isinstance(worker.loop._engine.proposer, NoProposer)  # no proposer, no draft model in memory
        assert "--speculative-config ignored: prefill workers do not speculate" in caplog.text
    finally:
        worker.stop()


@pytest.fixture(scope="module")
def ngram_decode(tiny_llama_dir, tiny):
    worker = serve_decode(WorkerConfig(engine=_engine(tiny_llama_dir, NGRAM), metrics_port=0), tiny)
    yield worker
    worker.stop()


def _scrape(port: int) -> dict[str, float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(body) for s in f.samples
            if s.name.startswith(SPEC)}


def _settled(worker, timeout_s: float = 10.0):
    """/metrics and the engine's stats once the loop has counted its last step (it streams a
    step's tokens before it takes the step's stats)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = worker.loop.stats
        m = _scrape(worker.metrics_port)
        done = stats.num_running == 0 and m[SPEC + "verifications_total"] == stats.num_spec_verifications
        if done or time.monotonic() > deadline:
            return m, stats
        time.sleep(0.05)


def test_a_decode_worker_serves_its_speculation_counters(ngram_decode):
    assert _scrape(ngram_decode.metrics_port)[SPEC + "proposed_tokens_total"] == 0
    prompt = [5, 6, 7, 8, 9] * 8  # the tiny model falls into a loop n-gram lookup then predicts
    with channel(ngram_decode.address) as ch:
        msgs = list(decode_pb2_grpc.DecodeWorkerStub(ch).Decode(decode_pb2.DecodeRequest(
            req_id="spec", prompt_token_ids=prompt,
            sampling=common_pb2.SamplingParams(temperature=0, max_tokens=24)), timeout=120))
    assert sum(len(m.token_ids) for m in msgs) == 24
    assert len(msgs) < 24  # accepted drafts arrive together: fewer steps than tokens
    m, stats = _settled(ngram_decode)
    assert m[SPEC + "proposed_tokens_total"] == stats.num_spec_proposed_tokens > 0
    assert m[SPEC + "accepted_tokens_total"] == stats.num_spec_accepted_tokens > 0
    assert m[SPEC + "verifications_total"] == stats.num_spec_verifications > 0
    assert m[SPEC + "acceptance_rate"] == pytest.approx(stats.num_spec_accepted_tokens / stats.num_spec_proposed_tokens)
    assert m[SPEC + "mean_accepted_length"] == pytest.approx(
        stats.num_spec_accepted_tokens / stats.num_spec_verifications)

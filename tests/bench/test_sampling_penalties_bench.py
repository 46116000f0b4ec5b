"""bench/sampling_penalties.py without vLLM: its pure parts (the settings both engines get,
the run order, the ratios, the CPU flags) and its --quick run end to end on the tiny Llama."""
from __future__ import annotations

import json

import pytest

from bench import sampling_penalties as bench
from pdserve.engine.sampling_params import SamplingParams

VOCAB = 49152
EOS = frozenset({2})


def params(setting: str, max_tokens: int = 64) -> dict:
    return bench.setting_params(setting, vocab_size=VOCAB, max_tokens=max_tokens, eos_token_ids=EOS)


def test_prompts_are_random_ids_of_about_the_asked_length_and_fixed_by_the_seed():
    prompts = bench.make_prompts(VOCAB, 32, 128, seed=0)
    assert len(prompts) == 32 and all(112 <= len(p) <= 144 for p in prompts)
    assert all(bench.FIRST_ID <= t < VOCAB for p in prompts for t in p)
    assert prompts == bench.make_prompts(VOCAB, 32, 128, seed=0) != bench.make_prompts(VOCAB, 32, 128, seed=1)


def test_plain_is_greedy_to_length_and_nothing_else():
    assert params("plain") == {"temperature": 0.0, "max_tokens": 64, "ignore_eos": True}
    assert not SamplingParams(**params("plain")).processes_logits


def test_penalties_bias_fifty_ids_within_five():
    p = params("penalties")
    assert (p["repetition_penalty"], p["presence_penalty"], p["frequency_penalty"]) == (1.1, 0.5, 0.5)
    assert len(p["logit_bias"]) == 50 and all(bench.FIRST_ID <= t < VOCAB for t in p["logit_bias"])
    assert all(-5 <= b <= 5 for b in p["logit_bias"].values())
    assert p == params("penalties")  # the same ids for both engines and every run


def test_masks_keep_eos_masked_to_the_last_token_and_ban_words():
    p = params("masks")
    assert p["min_tokens"] == p["max_tokens"] == 64 and p["stop_token_ids"] == [2]
    assert p["bad_words"] == bench.BAD_WORDS and len(p["bad_words"]) == 16


def test_allowed_ids_are_distinct_and_in_the_vocabulary():
    ids = params("allowed")["allowed_token_ids"]
    assert len(set(ids)) == len(ids) == 1024 and ids == sorted(ids) and ids[-1] < VOCAB


@pytest.mark.parametrize("setting", bench.SETTINGS)
def test_every_setting_is_valid_for_the_engine_and_survives_json(setting):
    p = params(setting)
    assert SamplingParams(**p).processes_logits == (setting != "plain")
    back = json.loads(json.dumps(p))  # how the vLLM script receives it: logit_bias keys become strings
    assert {int(k): v for k, v in back.get("logit_bias", {}).items()} == p.get("logit_bias", {})


def test_an_unknown_setting_is_refused():
    with pytest.raises(ValueError, match="unknown setting 'top_k'"):
        params("top_k")


def test_the_warm_up_is_short_and_keeps_min_tokens_within_it():
    warm = bench.warmup_params(params("masks"))
    assert warm["max_tokens"] == warm["min_tokens"] == bench.WARM_MAX_TOKENS
    assert bench.warmup_params(params("plain")) == dict(params("plain"), max_tokens=bench.WARM_MAX_TOKENS)


def test_each_round_runs_every_setting_once_rotated():
    assert bench.run_order(["plain", "penalties", "masks"], 3) == [
        (0, "plain"), (0, "penalties"), (0, "masks"),
        (1, "penalties"), (1, "masks"), (1, "plain"),
        (2, "masks"), (2, "plain"), (2, "penalties")]


def test_ratios_against_plain_per_engine_and_against_vllm_per_setting():
    rates = {"pdserve": {"plain": 100.0, "penalties": 90.0}, "vllm": {"plain": 80.0, "penalties": 40.0}}
    assert bench.summarize(rates) == {"pdserve_penalties_vs_plain": 0.9, "vllm_penalties_vs_plain": 0.5,
                                      "pdserve_vs_vllm_plain": 1.25, "pdserve_vs_vllm_penalties": 2.25}
    assert bench.summarize({"pdserve": rates["pdserve"]}) == {"pdserve_penalties_vs_plain": 0.9}


def test_the_table_marks_what_was_not_measured():
    rates = {"pdserve": {"plain": 100.0, "masks": 50.0}}
    lines = bench.table(rates, bench.summarize(rates), {}, 4).splitlines()
    assert lines[2:] == ["| plain | 100.0 | 1.0 | — | — | — | — |", "| masks | 50.0 | 0.5 | — | — | — | — |"]


def test_a_request_that_stops_short_is_an_error():
    assert bench.run_row("vllm", "plain", 0, 2.0, [[1] * 8, [2] * 8], 8)["output_tok_s"] == 8.0
    with pytest.raises(RuntimeError, match="stopped before 8 tokens"):
        bench.run_row("vllm", "plain", 0, 2.0, [[1] * 8, [2] * 7], 8)


def test_quick_is_small_and_pdserve_only():
    args = bench.parse_args(["--quick", "--vllm-python", "/nowhere/python"])
    assert (args.num_prompts, args.max_tokens, args.repeats, args.vllm_python) == (4, 8, 1, None)
    with pytest.raises(SystemExit):
        bench.parse_args(["--settings", "penalties"])  # nothing to compare it with


def test_the_peer_lines_are_read_among_vllms_own_and_emitted_as_rows(capsys):
    p = {"plain": params("plain", 2), "masks": params("masks", 2)}
    lines = ["INFO 12-02 vllm says hello\n",
             'PEER_ROW {"setting": "plain", "round": 0, "seconds": 0.5, "token_ids": [[1, 2], [3, 4]]}\n',
             'PEER_ROW {"setting": "masks", "round": 0, "seconds": 1.0, "token_ids": [[1, 2], [3, 4]]}\n',
             'PEER_RESULT {"startup_s": 60.0, "token_ids": {}}\n', "INFO shutting down\n"]
    seconds, result = bench.read_peer_lines(lines, p)
    assert seconds == {"plain": [0.5], "masks": [1.0]} and result == {"startup_s": 60.0, "token_ids": {}}
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["engine"], r["setting"], r["output_tok_s"]) for r in rows] == [("vllm", "plain", 8.0),
                                                                             ("vllm", "masks", 4.0)]
    assert bench.read_peer_lines(lines[:2], p)[1] is None  # died before its result


def test_the_vllm_script_is_valid_python():
    compile(bench.VLLM_SCRIPT, "vllm_penalties.py", "exec")


def test_quick_runs_every_setting_on_the_tiny_llama(tiny_llama_dir, capsys):
    bench.main(["--quick", "--model", tiny_llama_dir])
    lines = capsys.readouterr().out.splitlines()
    rows, result = [json.loads(line) for line in lines[:-1]], json.loads(lines[-1])
    assert [(r["engine"], r["setting"], r["output_tokens"]) for r in rows] == \
        [("pdserve", s, 32) for s in bench.SETTINGS]
    assert set(result["pdserve_output_tok_s"]) == set(bench.SETTINGS)
    assert {f"pdserve_{s}_vs_plain" for s in bench.SETTINGS[1:]} <= result.keys()
    assert "vllm_output_tok_s" not in result and "avx2" in result["cpu"]

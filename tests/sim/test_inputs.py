"""Traces, profiles and the command line: bad input names its field."""
import json
from dataclasses import replace

import pytest

from pdserve.cli.main import main
from pdserve.sim.profile import SchedulerLimits, Table1D, load_profile, profile_from_json
from pdserve.sim.trace import TraceRequest, parse_trace, trace_lines
from tests.sim.helpers import flat_profile


def test_trace_round_trip_and_relative_times():
    lines = ['{"timestamp": 1000, "input_length": 10, "output_length": 2, "hash_ids": [1, 2]}',
             "", '{"timestamp": 1500, "input_length": 20, "output_length": 3}']
    assert parse_trace(lines) == [TraceRequest(0.0, 10, 2, (1, 2)), TraceRequest(0.5, 20, 3, ())]
    assert parse_trace(trace_lines(parse_trace(lines))) == parse_trace(lines)


@pytest.mark.parametrize("record, field", [
    ({"input_length": 1, "output_length": 1}, "missing field 'timestamp'"),
    ({"timestamp": 0, "output_length": 1}, "missing field 'input_length'"),
    ({"timestamp": 0, "input_length": "5", "output_length": 1}, "field 'input_length' must be an integer"),
    ({"timestamp": 0, "input_length": 5, "output_length": 0}, "field 'output_length' must be >= 1"),
    ({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": ["a"]}, "field 'hash_ids'"),
])
def test_trace_errors_name_line_and_field(record, field):
    good = '{"timestamp": 0, "input_length": 1, "output_length": 1}'
    with pytest.raises(ValueError, match=f"t.jsonl line 2: {field}"):
        parse_trace([good, json.dumps(record)], source="t.jsonl")


def test_trace_going_backwards_is_refused():
    with pytest.raises(ValueError, match="line 2: field 'timestamp' goes backwards"):
        parse_trace(['{"timestamp": 5, "input_length": 1, "output_length": 1}',
                     '{"timestamp": 4, "input_length": 1, "output_length": 1}'])


def test_profile_round_trip_and_errors():
    raw = flat_profile().to_json()
    assert profile_from_json(raw) == flat_profile()
    calibrated = replace(flat_profile(), request_overhead_s=0.01, step_overhead_s=0.002, kv_cpu_share=1.0,
                         handoff_overhead_s=0.02, neighbour_prefill_factor=1.2, neighbour_decode_factor=1.4)
    assert profile_from_json(calibrated.to_json()) == calibrated
    with pytest.raises(ValueError, match="field 'neighbour_decode_factor' must be a number"):
        profile_from_json({**raw, "neighbour_decode_factor": "fast"})
    with pytest.raises(ValueError, match="field 'kv_bytes_per_token' must be an integer"):
        profile_from_json({**raw, "kv_bytes_per_token": None})
    with pytest.raises(ValueError, match="field 'decode.batch_sizes' must be a list of integers"):
        profile_from_json({**raw, "decode": {**raw["decode"], "batch_sizes": ["one"]}})
    del raw["decode"]["contexts"]
    with pytest.raises(ValueError, match="missing field 'decode.contexts'"):
        profile_from_json(raw)
    with pytest.raises(ValueError, match="field 'source'"):
        profile_from_json({**flat_profile().to_json(), "source": "made up"})


def test_a_profiles_scheduler_limits_default_to_the_engines_own():
    from pdserve.engine.config import CacheConfig, SchedulerConfig
    limits = SchedulerLimits()
    engine = SchedulerConfig()
    assert (limits.max_num_seqs, limits.max_num_batched_tokens, limits.long_prefill_token_threshold,
            limits.block_size) == (engine.max_num_seqs, engine.max_num_batched_tokens,
                                   engine.long_prefill_token_threshold, CacheConfig().block_size)


def test_shipped_gpu_profile_is_labelled_hand_written():
    p = load_profile("sim/profiles/h100_llama8b.json")
    assert p.source.startswith("hand-written from published numbers")
    assert p.prefill_s(8192) > p.prefill_s(512) > 0 and p.decode_step_s(256, 4096) > p.decode_step_s(1, 128)


def test_step_cost_interpolates_and_mixes():
    p = flat_profile()
    assert p.prefill_s(500) == pytest.approx(0.060)
    assert p.decode_step_s(32, 100) == pytest.approx(0.021 + 31 / 63 * 0.063)
    assert p.step_s([100], 2, 50) == pytest.approx(p.prefill_s(102))  # context-free decode: no extra
    assert p.step_s([], 2, 50) == pytest.approx(p.decode_step_s(2, 50))


def test_a_step_of_several_prompts_pays_the_fixed_part_once_and_each_prompts_own_attention():
    # 0.1 s fixed, then each prompt's cost grows faster than its length (attention)
    p = replace(flat_profile(), prefill=Table1D((0.0, 400.0, 1200.0), (0.1, 2.3, 9.0)))
    three = p.step_s([400, 400, 400], 0, 0.0)
    assert three == pytest.approx(0.1 + 3 * 2.2)
    assert three < p.prefill_s(1200)  # not one 1200-token prompt's attention
    assert p.step_s([400], 4, 0.0) == pytest.approx(p.prefill_s(400) + p.prefill_s(4) - 0.1)


@pytest.fixture
def files(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps({"timestamp": i * 500, "input_length": 200, "output_length": 20})
                               for i in range(10)) + "\n")
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps(flat_profile().to_json()))
    return str(trace), str(profile)


def test_sim_command_prints_latencies(files, capsys):
    trace, profile = files
    assert main(["sim", "--trace", trace, "--profile", profile, "--prefill", "1", "--decode", "1"]) == 0
    out = capsys.readouterr().out
    assert "1P+1D: 10 completed, 0 rejected" in out and "TTFT" in out and "SLO attainment 100.0%" in out


def test_sim_command_names_bad_inputs(files, capsys):
    trace, profile = files
    assert main(["sim", "--trace", "/nonexistent.jsonl", "--profile", profile]) == 2
    assert "--trace: cannot read /nonexistent.jsonl" in capsys.readouterr().err
    assert main(["sim", "--trace", trace, "--profile", profile, "--decode", "0"]) == 2
    assert "--decode" in capsys.readouterr().err


def test_sim_command_puts_workers_on_one_host_when_asked(files, tmp_path, capsys):
    trace = tmp_path / "dense.jsonl"  # prompts long enough for the prefill pool, arriving while others decode
    trace.write_text("\n".join(json.dumps({"timestamp": i * 100, "input_length": 3000, "output_length": 20})
                               for i in range(10)) + "\n")
    crowded = tmp_path / "crowded.json"
    crowded.write_text(json.dumps(replace(flat_profile(), neighbour_prefill_factor=2.0,
                                          neighbour_decode_factor=2.0).to_json()))
    args = ["sim", "--trace", str(trace), "--profile", str(crowded), "--prefill", "1", "--decode", "1", "--json"]
    ttft = {}
    for hosts in ("1", "2"):
        assert main(args + ["--workers-per-host", hosts]) == 0
        ttft[hosts] = json.loads(capsys.readouterr().out)["ttft_s"]["p90"]
    assert ttft["2"] > ttft["1"]  # a prefill beside a decoding stream runs at the factor
    assert main(args + ["--workers-per-host", "0"]) == 2
    assert "--workers-per-host" in capsys.readouterr().err


def test_plan_command_prints_ranked_choices(files, capsys):
    trace, profile = files
    assert main(["plan", "--trace", trace, "--profile", profile, "--max-workers", "2", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") >= 6 and "   1  colocated x1" in out

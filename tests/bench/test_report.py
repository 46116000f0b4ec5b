"""bench/report.py: the shared tail of the bench scripts prints what docs/benchmarks.md and
the script tests read: JSON lines, ratios keyed by the two conditions, markdown tables."""
from __future__ import annotations

import io
import json

from bench.report import emit_result, emit_row, markdown_row, markdown_table, ratios


def test_a_row_is_one_json_line_on_the_stream_given(capsys):
    err = io.StringIO()
    emit_row({"batch": 1, "step_ms": 2.5}, err)
    emit_row({"batch": 4})
    assert json.loads(err.getvalue()) == {"batch": 1, "step_ms": 2.5}
    assert capsys.readouterr().out == '{"batch": 4}\n'


def test_the_result_is_the_last_stdout_line(capsys):
    emit_result({"model": "m", "rows": [1, 2]})
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == {"model": "m", "rows": [1, 2]}


def test_ratios_name_both_sides_and_skip_a_side_not_measured():
    values = {"off": 30.0, "local": 10.0, "kvstore": 20.0}
    assert ratios(values, [("off", "local"), ("off", "kvstore"), ("off", "missing")], "ttft_ratio_{a}_vs_{b}") == \
        {"ttft_ratio_off_vs_local": 3.0, "ttft_ratio_off_vs_kvstore": 1.5}


def test_ratios_round_when_asked():
    assert ratios({"a": 1.0, "b": 3.0}, [("a", "b")], "{a}_vs_{b}", digits=2) == {"a_vs_b": 0.33}
    assert ratios({"a": 1.0, "b": 3.0}, [("a", "b")], "{a}_vs_{b}") == {"a_vs_b": 1 / 3}


def test_a_markdown_table_aligns_its_last_columns_right():
    table = markdown_table(["workload", "metric", "ms"], [["chat", "TTFT p50", "1.5"]], num_right_aligned=1)
    assert table.splitlines() == ["| workload | metric | ms |", "|---|---|---:|", "| chat | TTFT p50 | 1.5 |"]
    assert markdown_row([3, 1, "50.0"]) == "| 3 | 1 | 50.0 |"

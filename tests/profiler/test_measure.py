"""`pdserve profile` measures a real engine and a real kvstore on the tiny model."""
import json

import pytest

from pdserve.cli.main import main
from pdserve.sim.profile import load_profile


def test_profile_command_measures_every_grid_point_and_the_engines_limits(tiny_llama_dir, tmp_path):
    out = tmp_path / "p.json"
    assert main(["profile", "--model", tiny_llama_dir, "--out", str(out), "--prefill-tokens", "8,40",
                 "--batch-sizes", "1,3", "--contexts", "8,24", "--kv-blocks", "1,2", "--repeats", "2"]) == 0
    p = load_profile(str(out))
    assert p.source.startswith("measured on ") and "1 torch thread(s)" in p.source
    assert p.prefill.xs == (8.0, 40.0) and all(s > 0 for s in p.prefill.ys)
    assert p.decode_batch_sizes == (1, 3) and p.decode_contexts == (8, 24)
    assert all(s > 0 for row in p.decode_s for s in row)
    assert len(p.kv_put.xs) == 2 and p.kv_put.xs[1] == 2 * p.kv_put.xs[0] and all(s > 0 for s in p.kv_get.ys)
    # the bytes a token's KV takes: one block's bytes over its tokens
    assert p.kv_bytes_per_token * p.scheduler.block_size == p.kv_put.xs[0]
    assert p.kv_cpu_share == 1.0  # measured on a CPU: the transfer runs on the worker's cores
    assert json.loads(out.read_text())["scheduler"]["long_prefill_token_threshold"] == \
        p.scheduler.long_prefill_token_threshold > 0


@pytest.mark.parametrize("flag, value", [("--repeats", "0"), ("--threads", "0")])
def test_profile_command_refuses_bad_counts_naming_the_flag(tiny_llama_dir, tmp_path, flag, value, capsys):
    code = main(["profile", "--model", tiny_llama_dir, "--out", str(tmp_path / "p.json"), flag, value])
    assert code == 2 and flag in capsys.readouterr().err

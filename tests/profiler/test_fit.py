"""The cost-model fits that smooth a profile's medians (profiler/fit.py)."""
import pytest

from pdserve.profiler.fit import fit_decode, fit_prefill


def test_the_decode_fit_smooths_one_slow_point_and_keeps_small_grids():
    batches, contexts = (1, 2, 4, 8), (32, 256, 768)
    true = [[0.1 + 0.01 * b + 2e-5 * b * c for c in contexts] for b in batches]
    noisy = [row[:] for row in true]
    noisy[1][1] *= 1.25  # one point measured in a slow minute
    fitted, worst = fit_decode(batches, contexts, noisy)
    assert abs(fitted[1][1] / true[1][1] - 1) < 0.1 and worst > 0.1
    exact = fit_decode(batches, contexts, true)[0]
    assert [v for row in exact for v in row] == pytest.approx([v for row in true for v in row])
    assert fit_decode((1,), (8, 24), [[0.1, 0.12]]) == (((0.1, 0.12),), 0.0)  # too few points to fit


def test_the_prefill_fit_smooths_one_prompt_points_and_keeps_multi_prompt_ones():
    tokens = (16, 64, 128, 256, 384, 448, 512, 1024)
    true = [0.2 + 0.002 * t + 1e-5 * t * t for t in tokens]
    noisy = true[:]
    noisy[5] *= 1.2   # 448: one slow point
    noisy[7] = 7.0    # two 512-token prompts: not on the one-prompt curve, kept
    fitted, worst = fit_prefill(tokens, noisy, threshold=512)
    assert abs(fitted[5] / true[5] - 1) < 0.08 and worst > 0.1 and fitted[7] == 7.0
    exact, zero = fit_prefill(tokens[:7], true[:7], threshold=512)
    assert exact == pytest.approx(tuple(true[:7])) and zero == pytest.approx(0.0, abs=1e-9)
    assert fit_prefill((16, 64, 1024), (0.2, 0.4, 7.0), threshold=512) == ((0.2, 0.4, 7.0), 0.0)

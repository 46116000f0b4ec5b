"""The cost models a profile's measured medians are smoothed by: this VM's speed drifts by
tens of percent within minutes, so a median of a few samples can land far off the curve its
neighbours draw, and a fit of the step's known shape takes it from all of them. Pure numpy,
testable without an engine."""
from __future__ import annotations


def fit_prefill(tokens, medians, threshold: int) -> tuple[tuple[float, ...], float]:
    """The one-prompt prefill points (up to the chunk threshold) as the fit of
    a + b*T + c*T^2 to their medians (the weights read once, the per-token layers, the
    attention), least squares on relative error so the short prompts weigh as much as the
    long ones; and the largest relative gap between a median and the fit. Points past the
    threshold (several prompts a step) keep their medians, as do grids of fewer than four
    one-prompt points or a fit that is not positive."""
    import numpy as np
    x, y = np.array(tokens, dtype=float), np.array(medians, dtype=float)
    one = x <= threshold
    if one.sum() >= 4:
        design = np.stack([np.ones(one.sum()), x[one], x[one] ** 2], axis=1)
        coef = np.linalg.lstsq(design / y[one, None], np.ones(one.sum()), rcond=None)[0]
        fit = design @ coef
        if (fit > 0).all():
            out = y.copy()
            out[one] = fit
            return tuple(float(v) for v in out), float(np.max(np.abs(y[one] / fit - 1.0)))
    return tuple(float(v) for v in y), 0.0


def fit_decode(batch_sizes, contexts, medians) -> tuple[tuple[tuple[float, ...], ...], float]:
    """The decode table as the least-squares fit of a + b*B + c*B*C to its medians (the
    weights read once a step, each sequence's own layers, the attention over its context),
    and the largest relative gap between a median and the fit. A decode point's repeats run
    back to back, so a slow minute of this VM moves a whole point (by up to 24% here); the
    fit takes its shape from all of them. Fewer than four points, or a fit that is not
    positive everywhere, keep the medians."""
    import numpy as np
    x = np.array([[1.0, b, b * c] for b in batch_sizes for c in contexts])
    y = np.array(medians, dtype=float).reshape(-1)
    if len(y) >= 4:
        fit = x @ np.linalg.lstsq(x, y, rcond=None)[0]
        if (fit > 0).all():
            worst = float(np.max(np.abs(y / fit - 1.0)))
            return tuple(tuple(float(v) for v in row) for row in fit.reshape(len(batch_sizes), -1)), worst
    return tuple(tuple(float(v) for v in row) for row in medians), 0.0

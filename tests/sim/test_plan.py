"""`pdserve plan`'s search ranks by simulated goodput per worker."""
from pdserve.services.router.config import PathConfig, RouterConfig
from pdserve.sim.plan import search
from pdserve.sim.trace import TraceRequest
from tests.sim.helpers import flat_profile


def test_light_load_one_colocated_worker_is_best():
    trace = [TraceRequest(i * 0.5, 100, 10) for i in range(20)]
    choices = search(trace, flat_profile(), RouterConfig(), 0.5, 0.05, max_workers=2)
    assert (choices[0].num_prefill, choices[0].num_decode) == (0, 1)
    assert len(choices) == 3  # colocated x1, colocated x2, 1P:1D


def test_prefill_heavy_load_needs_the_prefill_pool():
    """Long prompts arriving faster than one worker prefills them: one worker misses the
    TTFT SLO; disaggregated, decode streams keep their TPOT while a prefill worker takes
    the prompts, so a P:D split wins over colocated pools of the same size."""
    trace = [TraceRequest(i * 0.25, 2000, 40) for i in range(80)]
    router = RouterConfig(paths=PathConfig(policy="threshold"), short_prompt_tokens=0)
    choices = search(trace, flat_profile(long_prefill_token_threshold=512), router, 1.0, 0.03, max_workers=3)
    best = choices[0]
    assert best.num_prefill >= 1, [(c.label, c.summary["goodput_rps_per_worker"]) for c in choices]
    assert best.summary["slo_attainment"] > 0.9
    colocated1 = next(c for c in choices if (c.num_prefill, c.num_decode) == (0, 1))
    assert colocated1.summary["slo_attainment"] < 0.5

"""The router's decisions, with no I/O: pure functions of snapshots, so the live router and
the simulator (sim/router.py) run the same code, and each is tested in milliseconds.
Nothing here imports gRPC, FastAPI or torch (tests/services/router/decide/test_purity.py).

    config.py      the settings they read: SLO classes, saturation, path policy
    views.py       WorkerView, PrefixMatch, the PrefixIndex contract (and NoPrefixes)
    paths.py       which path a request takes (direct or through the prefill pool)
    policy.py      placement strategies: which worker of a pool
    placement.py   which strategy each pool uses (RoutingConfig.placement)
    saturation.py  when a worker takes no new work
    slots.py       choose_slot: saturation, then placement, and the tokens to reserve
"""

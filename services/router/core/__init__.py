"""One request's way through the router, after a front has parsed it:

    front.py      validate, run inside the drain, count the outcome
    drain.py      on stop: refuse new requests, cut those past the drain timeout
    request.py    GenerateInput -> RoutedRequest (validation, tokenizing, SLO class)
    flow.py       the path, the pools, the worker calls, retries and migrations
    pools.py      a slot on a worker now or after the admission queue (admission.py)
    calls.py      the gRPC calls to prefill and decode workers
    stream.py     the decode stream back to the client, with its latencies
    migration.py  a broken decode stream resumed on another worker
    cancel.py     a client's cancel, seen by every step
"""

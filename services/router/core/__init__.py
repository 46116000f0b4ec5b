"""One request's way through the router, after a front has parsed it:

    front.py           validate, run inside the drain, count the outcome
    drain.py           on stop: refuse new requests, cut those past the drain timeout
    request.py         GenerateInput -> RoutedRequest (validation, tokenizing, SLO class)
    flow.py            the path, the prefill's choices and their hand-off to decodes
    completions.py     what depends on n, decided once per request: one completion, or n
                       side by side (parallel.py, from the parts in choices.py)
    attempts.py        each worker call, retried (or migrated) on another worker
    decode_request.py  every DecodeRequest the router sends
    pools.py           a slot on a worker now or after the admission queue (admission.py)
    calls.py           the gRPC calls to prefill and decode workers
    stream.py          the decode stream back to the client, with its latencies
    migration.py       when a broken decode stream may resume on another worker
    cancel.py          a client's cancel, seen by every step
"""

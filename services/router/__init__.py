"""The router: validates and classifies each request, then sends it straight to a decode
worker (short prompts) or through a prefill worker and the kvstore to a decode worker,
with load-aware choices, SLO-class admission, retries and cancellation (docs/router.md)."""

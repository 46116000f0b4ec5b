"""`pdserve bench serve`: a serving benchmark against the router (gRPC) or any
OpenAI-compatible HTTP server. See docs/benchmarks_history.md, "Serving experiments"."""

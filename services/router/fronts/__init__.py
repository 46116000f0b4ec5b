"""The router's two fronts, each only its wire form around the one Front (core/front.py):
gRPC Router.Generate (grpc_servicer.py, wire.py: the servicer's registration) and the
OpenAI-compatible HTTP API (http/)."""

"""/metrics over HTTP: prometheus_client's WSGI app on a threading server, with one fix to
its content negotiation.

A Prometheus 2 scraper asks for OpenMetrics without naming an escaping scheme, and
prometheus_client then escapes with "underscores", which (client_python#1177) turns the
colon of every sample name into an underscore while the HELP and TYPE lines keep it:
`vllm:num_requests_waiting` would be stored as `vllm_num_requests_waiting`, and no query
written for vLLM would find it. Every name pdserve exports is a legal classic name, colons
included, so OpenMetrics is always answered with "allow-utf-8", which writes such names
unchanged (the text format, 0.0.4, never escaped them).
"""
from __future__ import annotations

import socket
import threading
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

OPENMETRICS = "application/openmetrics-text"
KEEP_NAMES = "escaping=allow-utf-8"


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> ThreadingWSGIServer:
    """Serves `registry` at /metrics on a daemon thread; the server's port is the bound one."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    server_type = type("MetricsServer", (ThreadingWSGIServer,), {"address_family": family})
    server = make_server(host, port, _names_kept(make_wsgi_app(registry)), server_type, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, name=f"metrics-{server.server_port}", daemon=True).start()
    return server


def keep_names(accept: str) -> str:
    """The Accept header with every OpenMetrics choice asking for names unescaped."""
    choices = []
    for choice in accept.split(","):
        params = [p.strip() for p in choice.split(";")]
        if params[0] == OPENMETRICS:
            params = [p for p in params if not p.startswith("escaping=")] + [KEEP_NAMES]
        choices.append(";".join(params))
    return ",".join(choices)


def _names_kept(app):
    def kept(environ, start_response):
        if environ.get("HTTP_ACCEPT"):
            environ = dict(environ, HTTP_ACCEPT=keep_names(environ["HTTP_ACCEPT"]))
        return app(environ, start_response)
    return kept


class _Quiet(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # a scrape a second: not worth a log line
        pass

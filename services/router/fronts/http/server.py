"""The HTTP API's uvicorn server, on its own thread and event loop inside the router
process, started and stopped with the router (see services/router/server.py)."""
from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import uvicorn

from pdserve.services.common.tls import ServerTLS
from pdserve.services.router.fronts.http.app import create_app
from pdserve.services.router.fronts.http.backend import Backend
from pdserve.services.router.fronts.http.config import HttpConfig

logger = logging.getLogger(__name__)


class HttpServer:
    def __init__(self, cfg: HttpConfig, backend: Backend):
        self.cfg = cfg
        self._executor = ThreadPoolExecutor(cfg.max_threads, thread_name_prefix="router-http-run")
        app = create_app(backend, cfg, self._executor)
        # log_config=None: keep the process's logging as the service configured it
        config = uvicorn.Config(app, log_config=None, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=cfg.grace_s, **_ssl(cfg.tls))
        self._server = uvicorn.Server(config)
        self._socket = _bind(cfg.host, cfg.port)  # here, so a taken port fails the router's start
        self.port: int = self._socket.getsockname()[1]
        self._thread = threading.Thread(target=self._run, name="router-http", daemon=True)

    def start(self, timeout_s: float = 30.0) -> HttpServer:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop(0)
                raise RuntimeError(f"the HTTP API did not start on {self.cfg.host}:{self.port}")
            time.sleep(0.01)
        scheme = "https" if self.cfg.tls is not None else "http"
        logger.info("OpenAI-compatible API on %s://%s:%d/v1", scheme, self.cfg.host, self.port)
        if self.cfg.api_key is None:
            logger.warning("the HTTP API on %s:%d accepts any caller: no API key is configured "
                           "(see docs/security.md)", self.cfg.host, self.port)
        return self

    def stop(self, grace_s: float | None = None) -> None:
        """Stop accepting; open responses get `grace_s` (the config's by default), then
        they are cancelled, which aborts their requests on the workers."""
        if grace_s is not None:
            self._server.config.timeout_graceful_shutdown = grace_s
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=self._server.config.timeout_graceful_shutdown + 5)
        self._socket.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        try:
            self._server.run(sockets=[self._socket])
        except BaseException:  # uvicorn exits with SystemExit on startup failures
            logger.exception("the HTTP API server failed")


def _ssl(tls: ServerTLS | None) -> dict:
    """uvicorn's TLS settings: the certificate, and with a client CA, client certificates required."""
    if tls is None:
        return {}
    client = {"ssl_ca_certs": tls.client_ca_file, "ssl_cert_reqs": ssl.CERT_REQUIRED} if tls.client_ca_file else {}
    return {"ssl_certfile": tls.cert_file, "ssl_keyfile": tls.key_file, **client}


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"HTTP API: cannot listen on {host}:{port}: {e.strerror}") from None
    return sock

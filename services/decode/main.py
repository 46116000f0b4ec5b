"""`pdserve decode`: run one decode worker."""
from __future__ import annotations

from services.common import defaults
from services.decode.server import serve
from services.worker.runtime import worker_cli

add_arguments, run = worker_cli("decode", serve, default_port=defaults.DECODE_PORT)

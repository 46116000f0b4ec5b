"""`pdserve decode`: run one decode worker."""
from __future__ import annotations

from services.decode.server import serve
from services.common.worker import worker_cli

add_arguments, run = worker_cli("decode", serve, default_port=50080)

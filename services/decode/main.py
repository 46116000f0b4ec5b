"""`pdserve decode`: run one decode worker, or (--role both) one that serves the prefill
pool too over the same engine (services/both/server.py)."""
from __future__ import annotations

from pdserve.services.both.server import serve as serve_both
from pdserve.services.common import defaults
from pdserve.services.decode.server import serve
from pdserve.services.worker.runtime import worker_cli

add_arguments, run = worker_cli({"decode": serve, "both": serve_both}, default_port=defaults.DECODE_PORT)

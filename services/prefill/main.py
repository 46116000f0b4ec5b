"""`pdserve prefill`: run one prefill worker."""
from __future__ import annotations

from services.prefill.server import serve
from services.common.worker import worker_cli

add_arguments, run = worker_cli("prefill", serve, default_port=50070)

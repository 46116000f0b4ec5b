"""`pdserve prefill`: run one prefill worker."""
from __future__ import annotations

from services.common import defaults
from services.prefill.server import serve
from services.worker.runtime import worker_cli

add_arguments, run = worker_cli({"prefill": serve}, default_port=defaults.PREFILL_PORT)

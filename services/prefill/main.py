"""`pdserve prefill`: run one prefill worker."""
from __future__ import annotations

from pdserve.services.common import defaults
from pdserve.services.prefill.server import serve
from pdserve.services.worker.runtime import worker_cli

add_arguments, run = worker_cli({"prefill": serve}, default_port=defaults.PREFILL_PORT)

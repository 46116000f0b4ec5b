"""`pdserve prefill`: run one prefill worker."""
from __future__ import annotations

import argparse
import logging

from services.prefill.server import serve
from services.common.process import configure_logging, set_cpu_threads, wait_for_shutdown
from services.common.worker import add_worker_arguments, worker_config_from_args

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_worker_arguments(parser, default_port=50070)


def run(args) -> int:
    configure_logging("prefill")
    set_cpu_threads(args.threads)
    running = serve(worker_config_from_args(args))
    print(f"prefill worker serving on {args.host}:{running.server.port}", flush=True)
    wait_for_shutdown()
    logger.info("draining and stopping")
    running.stop()
    return 0

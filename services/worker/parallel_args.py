"""The tensor/pipeline parallelism flags, shared by `pdserve prefill|decode` and `pdserve generate`:
their defaults come from the engine's ParallelConfig, and a bad value names its flag."""
from __future__ import annotations

import argparse

from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.executor.config import ParallelConfig
from pdserve.services.common.numbers import number_arg

_PARALLEL = ParallelConfig()
# the flags `pdserve up` reads back from a worker's command line (cli/launcher.py: cores per rank)
TENSOR_PARALLEL_FLAGS = ("--tensor-parallel-size", "-tp")
PIPELINE_PARALLEL_FLAGS = ("--pipeline-parallel-size", "-pp")


positive_int = number_arg(int, low=1)
positive_seconds = number_arg(float, "a number of seconds", low=0, low_open=True)


def layer_split(text: str) -> tuple[int, ...]:
    """'20,12' -> (20, 12): the layers of each pipeline stage, first stage first."""
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        counts = ()
    if not counts or any(n < 1 for n in counts):
        raise argparse.ArgumentTypeError(f"expected layer counts >= 1 per pipeline stage, comma-separated "
                                         f"like 20,12, got {text!r}")
    return counts


def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    add_parallel_size_arguments(parser)
    parser.add_argument("--pipeline-layer-split", type=layer_split, default=_PARALLEL.pipeline_layer_split,
                        metavar="N,N,...", help="layers per pipeline stage, e.g. 20,12 (default: an even split)")
    parser.add_argument("--collective-timeout-s", type=positive_seconds, default=_PARALLEL.collective_timeout_s,
                        help="a collective (or the start-up rendezvous) that takes longer stops the engine with "
                             "an error: a dead or hung rank never hangs the worker")


def add_parallel_size_arguments(parser: argparse.ArgumentParser, pool: str = "") -> None:
    """-tp/--tensor-parallel-size and -pp/--pipeline-parallel-size; with a `pool`, `pdserve up`'s
    --<pool>-tensor-parallel-size and --<pool>-pipeline-parallel-size for that pool's workers."""
    tensor, pipeline = ((f"--{pool}-tensor-parallel-size",), (f"--{pool}-pipeline-parallel-size",)) if pool else (
        TENSOR_PARALLEL_FLAGS, PIPELINE_PARALLEL_FLAGS)
    dest = f"{pool}_" if pool else ""
    parser.add_argument(*tensor, dest=f"{dest}tensor_parallel_size", type=positive_int,
                        default=_PARALLEL.tensor_parallel_size, metavar="T",
                        help="tensor parallel ranks per pipeline stage (attention heads and MLP split T ways; "
                             "T must divide the model's KV heads)")
    parser.add_argument(*pipeline, dest=f"{dest}pipeline_parallel_size", type=positive_int,
                        default=_PARALLEL.pipeline_parallel_size, metavar="P",
                        help="pipeline stages, each a contiguous run of layers; the worker runs T x P processes "
                             "(under `pdserve up`, with T x P times the cores of a single-process worker)")


def parallel_config_from_args(args) -> ParallelConfig:
    """The flags into the engine's ParallelConfig; what only holds across flags (a split with
    one count per stage) is refused naming the flag, not the config field."""
    try:
        return ParallelConfig(tensor_parallel_size=args.tensor_parallel_size,
                              pipeline_parallel_size=args.pipeline_parallel_size,
                              pipeline_layer_split=args.pipeline_layer_split,
                              collective_timeout_s=args.collective_timeout_s)
    except InvalidRequestError as e:
        flag = "--" + e.field.replace("_", "-")
        raise InvalidRequestError(flag, str(e).removeprefix(f"{e.field}: ")) from None

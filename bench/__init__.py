"""The benchmark and check scripts, each run from the repository root as
`python -m bench.NAME` (docs/benchmarks.md). Repository tooling: not in the wheel."""

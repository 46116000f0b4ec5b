"""`python -m bench.gpu_check`: see the package's docstring (or --help)."""
import sys

from bench.gpu_check import main

sys.exit(main())

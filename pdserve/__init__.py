"""pdserve: disaggregated prefill/decode LLM serving with a vLLM-class engine.

The one import name the wheel installs. The repository keeps its top-level folders as the
design lays them out (engine/, services/, kernels/, cli/, sim/, profiler/, autoscale/), and
setup.py installs each as a subpackage of this one: `pdserve.engine`, `pdserve.services`, ...
so nothing of pdserve's lands in site-packages under a generic name (Hugging Face's
`kernels` is a real package of that name).
"""
import os as _os

# Run from a checkout without installing it (the repository root on PYTHONPATH, as
# bench/gpu_check/ runs on a machine that only has the working tree), this file sits in
# the checkout's pdserve/ folder and the subpackages one folder up: look for them there too.
# An installed pdserve (wheel or editable) has them beside it, or mapped, and is left alone.
_HERE = _os.path.dirname(_os.path.abspath(__file__))
_CHECKOUT = _os.path.dirname(_HERE)
if (not _os.path.isdir(_os.path.join(_HERE, "engine"))
        and _os.path.isfile(_os.path.join(_CHECKOUT, "setup.py"))
        and _os.path.isfile(_os.path.join(_CHECKOUT, "engine", "__init__.py"))):
    __path__.append(_CHECKOUT)

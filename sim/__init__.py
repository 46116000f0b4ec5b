"""A discrete-event simulator of a pdserve cluster: the router's own policy code, prefill
and decode pools (the engine's scheduler rules, step costs from a measured profile), the
KV hand-off, and HPA autoscaling; `pdserve sim`, `pdserve plan`. The profiles it reads are
measured by profiler/ (`pdserve profile`), which it never imports."""

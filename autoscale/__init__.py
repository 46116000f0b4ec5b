"""Kubernetes' HPA arithmetic with the chart's behaviour (hpa.py), the per-pod metrics it
reads (pod_metrics.py, adapter_query.py) and the controller that applies it to local pools
(controller.py). No service process of its own: `pdserve up --autoscale` drives the
controller and the simulator's day studies (sim/autoscale.py) drive the arithmetic."""

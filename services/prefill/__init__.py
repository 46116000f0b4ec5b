"""The prefill service (built with the disaggregated-serving issue)."""

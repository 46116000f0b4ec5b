"""The router service (built with the disaggregated-serving issue)."""

"""The kvstore service (built with the disaggregated-serving issue)."""

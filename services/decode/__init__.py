"""The decode service (built with the disaggregated-serving issue)."""

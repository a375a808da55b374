"""The planner's rates: the node's `RateBook`, per-tenant books, the rates kept across restarts,
calibration, and their gauges."""

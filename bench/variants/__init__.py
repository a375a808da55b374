"""Policy variants for `bench.policy_sweep --patch` (README.md)."""

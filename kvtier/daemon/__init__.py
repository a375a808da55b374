"""The daemon (`kvtier serve`): gRPC service, the cache facade and its load/store paths, tenants
and namespaces, leases, events, metrics, planner rates, configuration and lifecycle."""

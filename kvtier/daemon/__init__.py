"""The daemon (`kvtier serve`). Its top holds the process shell (server, config, reload, auth,
metrics, HTTP, sockets, fd passing); `rpc/` the transports (gRPC and the local socket, built from
one method table), `cache/` everything under the cache lock, `rates/` the planner's rates
(docs/ARCHITECTURE.md, "Layers and their contracts")."""

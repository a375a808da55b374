"""The transports: the gRPC servicer and the local socket, built from the method table
(`kvtier.core.methods`), their handlers, the bulk path and the size guard. The only daemon code
that imports gRPC or the generated protocol; it reaches the index and the tiers only through
`kvtier.daemon.cache.api`."""

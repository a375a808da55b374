"""The cache: everything that runs under the cache lock (leases, namespaces, the load and store
paths, residency over the index and the tiers, the journal applier, events, the remote tier).
Imports no transport and nothing of the shell: it is built from `kvtier.daemon.cache.spec`."""

#!/bin/sh
# Container entry point: runs `kvtier "$@"` with the DRAM pool sized from the container's memory
# limit, so the pool and the limit cannot disagree (a pool larger than the limit is an OOM kill
# waiting to happen). Unless KVTIER_DRAM_BYTES is set:
#   limit   = $KVTIER_MEMORY_LIMIT_BYTES (Kubernetes: resourceFieldRef limits.memory), else the
#             cgroup's memory.max (v2) or memory.limit_in_bytes (v1); no limit: kvtier's default
#   reserve = 512 MiB + limit / 16 (the daemon's own memory: index, gRPC, Python)
#   KVTIER_DRAM_BYTES = limit - reserve
# and the pool is allocated at start (KVTIER_DRAM_PREFAULT=true unless set), so its pages are
# charged to this container, not to the engine that first writes them, and a /dev/shm too small
# for it fails the start instead of a write later.
set -eu
limit=${KVTIER_MEMORY_LIMIT_BYTES:-}
if [ -z "$limit" ]; then
    for f in /sys/fs/cgroup/memory.max /sys/fs/cgroup/memory/memory.limit_in_bytes; do
        if [ -r "$f" ]; then limit=$(cat "$f"); break; fi
    done
fi
case "$limit" in ''|max|*[!0-9]*) limit= ;; esac
# cgroup v1 writes "no limit" as a huge number: treat anything over 1 PiB as none
if [ -n "$limit" ] && [ "$limit" -gt 1125899906842624 ]; then limit=; fi
if [ -z "${KVTIER_DRAM_BYTES:-}" ] && [ -n "$limit" ]; then
    reserve=$((536870912 + limit / 16))
    if [ "$limit" -le "$reserve" ]; then
        echo "kvtier entrypoint: memory limit $limit B leaves no room for a DRAM pool" \
             "(the daemon keeps $reserve B for itself); raise limits.memory" >&2
        exit 2
    fi
    KVTIER_DRAM_BYTES=$((limit - reserve))B
    export KVTIER_DRAM_BYTES
fi
: "${KVTIER_DRAM_PREFAULT:=true}"
export KVTIER_DRAM_PREFAULT
exec "${KVTIER_BIN:-kvtier}" "$@"

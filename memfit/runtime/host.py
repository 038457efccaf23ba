"""The host-tier buffers, imported from their home, ``memfit.graph.host`` (this path kept working)."""

from memfit.graph.host import (  # noqa: F401
    HostPool,
    host_copy,
    host_empty_like,
    host_storage_count,
    is_host_storage,
    register_host_storage,
)

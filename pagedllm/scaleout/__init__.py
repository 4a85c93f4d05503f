"""Scale-out on Ray: data-parallel replicas with prefix-aware routing, disaggregated prefill/decode,
prefix KV shared across replicas (the ``ray`` extra)."""

"""KV-cache storage tiers under the device prefix cache: host memory (host_pool), disk (disk_store), and
the two as one store (tiers). Host-side only: the runner's kv_transfer moves blocks to and from the device."""

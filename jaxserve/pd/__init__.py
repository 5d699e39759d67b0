"""Prefill/decode disaggregation: the control protocol, block reservations and leases, the KV transfer, the
instance roles and the router (README: "Prefill/decode disaggregation")."""

"""The registry role: stable names `role/instance` mapped to live addresses under leases."""

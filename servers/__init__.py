"""gymrpc servers: one package per role, all started through `servers.bootstrap`."""

"""gymrpc servers: one package per role, all started through `gymrpc.servers.bootstrap`."""

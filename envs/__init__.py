"""Environment plug-ins: each subpackage implements `gymrpc.envkit.Environment` and ships its example data.

They import nothing from grpc, so they can be tested (and reused) without a server.
"""

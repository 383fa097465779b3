"""Generated gRPC stubs for the gymrpc.v1 protocol. Do not edit: run tools/gen_protos.py."""

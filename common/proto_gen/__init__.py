"""Generated gRPC/protobuf stubs for proto/wedlm.proto (see regenerate.py)."""

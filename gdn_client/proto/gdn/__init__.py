"""Generated protobuf/gRPC stubs for gdn.v1 (make proto regenerates them)."""

"""The ext_proc gRPC server: per-stream state machine, health service, process lifecycle."""

"""Stand-ins for model servers (there are no GPUs here): the demo, tests and benchmarks
route to these."""

"""memfit benchmarks: synthetic stacks and real-size family sweeps (run on a GPU machine)."""

"""Test tooling used by the suite and the benchmarks: a fate-tracking SIGKILL storm."""

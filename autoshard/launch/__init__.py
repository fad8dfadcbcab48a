"""Run a plan under torchrun: SPMD sharding maps and pipeline stage plans."""

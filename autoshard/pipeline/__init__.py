"""Pipeline stages: layers, stage assignment, the per-stage ILP, pipeline pricing."""

"""autoshard: find how to shard a PyTorch model across a device mesh.

The data flow (one module per arrow, see docs/architecture.md):
``model_file`` -> ``trace`` -> ``strategies`` -> ``cost`` -> ``ilp`` -> ``export`` -> ``launch``.
"""

__version__ = "0.1.0"

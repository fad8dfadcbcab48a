"""autoshard: find how to shard a PyTorch model across a device mesh.

The data flow (one package per arrow, see docs/architecture.md):
``model`` -> ``trace`` -> ``strategies`` -> ``solver`` (priced by ``cost``) -> ``plan``
-> ``launch``.
"""

__version__ = "0.1.0"


def __getattr__(name: str):  # noqa: ANN202 - lazy: `import autoshard` stays light for the CLI
    """``autoshard.solve``, ``compare``, ``stages``, ``save`` and ``apply``
    (:mod:`autoshard.api`), imported on use."""
    if name in ("solve", "compare", "stages", "save", "apply"):
        from autoshard import api

        return getattr(api, name)
    raise AttributeError(f"module 'autoshard' has no attribute {name!r}")

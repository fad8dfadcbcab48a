"""The cost model: the mesh and its links, collectives and resharding, devices, memory, overlap."""

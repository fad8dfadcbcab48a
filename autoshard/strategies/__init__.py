"""Strategy generation: candidate placements per node and the edges between them."""

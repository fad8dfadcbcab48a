"""The search: the ILP, the hand-written plans, preloading, and the solve driver."""

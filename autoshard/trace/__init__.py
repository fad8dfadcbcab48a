"""Tracing: torch.export to an ATen graph on the meta device, with shapes and FLOPs."""

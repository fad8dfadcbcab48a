"""The plan: its pricing, reports, file formats (readers and writers) and export."""

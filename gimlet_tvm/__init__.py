"""gimlet-tvm."""

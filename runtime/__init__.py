"""meshpar's runtime: executes what the passes emit."""

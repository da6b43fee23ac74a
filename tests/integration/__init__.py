"""Integration tests: real FUSE mounts of zonefs-py in a subprocess."""

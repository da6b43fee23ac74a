"""zonefs-py: a FUSE log-structured filesystem for zoned SSDs."""

__version__ = "0.1.0"

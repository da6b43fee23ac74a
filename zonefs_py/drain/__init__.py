"""Burst buffer: files drain to an S3 object store; retention evicts; reads restore.

store: the S3 client (boto3, worker threads). manager: the engine hooks,
eviction and restore. drainer: the background upload task. The per-file
state machine is zonefs_py/model/drain.py. See docs/DESIGN.md section 6.
"""

"""Burst buffer: files drain to an S3 object store; retention evicts; reads restore.

model: the per-file state machine (pure). store: the S3 client (boto3, worker
threads). manager: the engine hooks, eviction and restore. drainer: the
background upload task. See docs/DESIGN.md "Drain to an object store".
"""

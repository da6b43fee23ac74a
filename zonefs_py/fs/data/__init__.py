"""The engine's data path: the bytes of files between FUSE and the zones.

`DataPath` (datapath.py) is the one object the rest of the engine holds; the
modules behind it:

* writestate.py: per-file write state (buffers, chunks in flight, arrivals);
* writepipe.py: chunks appended to zones, their EXTENT ops applied in order
  (append_order.py: appends at a zone's write pointer in reservation order);
* readpath.py: reads (extents, in-flight chunks, buffers; the fast path) and
  the read maps it publishes to the C data plane (zonefs_py/dataplane,
  DESIGN 4.10) through `ReadPath.maps`;
* prefetch.py: sequential read-ahead of stored data;
* qos.py: the read-latency controller that paces appends;
* tenantqos.py: declared tenants' write caps and read shares (work-conserving
  token buckets appends wait in; per-tenant read and write rates);
* zonesums.py: zone summaries: sealing, the checksum cache.
"""

"""On-device index: a copy-on-write B+tree over append-only pages (issue 32 groundwork).

Layers inside the package, bottom up: `errors`, `page` (pure encode/decode,
no I/O), `store` (`PageStore` protocol; memory and zone-append stores),
`memzone` (an in-memory zone-append fake for tests), `cache` (bounded LRU of
decoded pages, dirty pages held outside the budget), `btree` (the tree).

Caveats: nothing here is wired into the engine yet; docs/INDEX-DRAFT.md lists
what is missing (journal as memtable, DISK_VERSION 5, format-4 conversion,
fsck walk, meta-zone cleaning policy).
"""

"""On-device index: a copy-on-write B+tree over append-only pages (format 5's namespace).

Layers inside the package, bottom up: `errors`, `page` (pure encode/decode,
no I/O), `store` (`PageStore` protocol; memory and zone-append stores, for
tests), `memzone` (an in-memory zone-append fake for tests), `cache` (bounded
LRU of decoded pages, dirty pages held outside the budget), `btree` (the
tree). The engine's store is `journal/nsindex.py` `MetaPageStore` (pages in
meta zones); the page format is docs/SPEC.md "Namespace index (version 5)",
the design docs/DESIGN.md §3.14.

Caveats: synchronous code with no `await` (run in worker threads and in
recovery); a page's checksum does not cover its address; keys are stored
whole (no prefix compression). What format 5 does not do yet (lazy loading,
conversion from format 4) is listed in docs/DESIGN.md §3.14.
"""

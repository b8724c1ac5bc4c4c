"""KV cache bookkeeping, pure Python: the block pool (:mod:`.block_pool`), block tables, prefix lookup and
allocation (:mod:`.manager`), chained block hashes (:mod:`.hashing`) and how many blocks to allocate
(:mod:`.sizing`). The KV tensors and the paged attention that reads them are model compute, in
:mod:`llminfer.backends.attention`."""

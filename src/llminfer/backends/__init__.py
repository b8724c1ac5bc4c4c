"""The model step: the backend registry (:mod:`.registry`: every backend, its builder, its engine core and
what it can do), the step backends that run one engine step (:mod:`.base` with the ``execute`` envelope,
:mod:`.packing`; eager :mod:`.hf`, :mod:`.compiled`, :mod:`.speculative`; :mod:`.vllm` is a whole engine
core), the paged attention and KV tensors they share (:mod:`.attention`), and the model-loading helpers
(:mod:`.loading`, :mod:`.quant`, :mod:`.prepack`)."""

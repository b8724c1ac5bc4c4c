"""The model step: backends that run one engine step (eager :mod:`.hf`, :mod:`.compiled`,
:mod:`.speculative`; :mod:`.vllm` is a whole engine core), the paged attention and KV tensors they share
(:mod:`.attention`), and the model-loading helpers (:mod:`.loading`, :mod:`.quant`, :mod:`.prepack`)."""

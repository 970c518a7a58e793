"""Support for the tests and benchmarks, never imported by the product:
independent references (:mod:`.reference`), an SGLang-style reference layer
loop (:mod:`.reference_loop`), benchmark timers (:mod:`.bench`) and the kernel
launched alone or through the ops on CPU tensors under Triton's interpreter
(:mod:`.kernel`)."""

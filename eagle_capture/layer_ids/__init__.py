"""Which target layers an EAGLE-3 draft receives, per SGLang release line, and
the doctor that says it: :mod:`.lines` (the release table), :mod:`.plan`
(capture plans: layer -> slot), :mod:`.deployment` (TP, DP attention, fusion,
CUDA graphs) and :mod:`.doctor` (the ``eagle-capture doctor`` CLI). Pure
Python: no GPU, no SGLang needed."""

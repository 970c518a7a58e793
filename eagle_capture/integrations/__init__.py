"""Serving-engine integrations of the fused capture, each in a folder of its
own (SGLang today), built on the core ops and the layer-id doctor."""

"""Whole pretrained models: a transformers model (a `save_pretrained` folder, a model id or a GGUF
file) exported as step graphs with a known cache, checked against itself in float64, quantized,
timed, and loaded by the clients its users run. docs/layout.md names each module's job."""

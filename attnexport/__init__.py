"""attnexport: attention layers exported to ONNX, checked against golden outputs, timed."""

__version__ = "0.1.0"

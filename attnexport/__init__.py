"""attnexport: attention layers exported to ONNX, checked against golden outputs, timed."""

__version__ = "0.1.0"


def export_module(module, example_inputs, **kwargs):
    """Exports your own attention module through attnexport's core: see `attnexport.modules.export_module`."""
    from attnexport.modules import export_module as export
    return export(module, example_inputs, **kwargs)

"""attnexport: attention layers exported to ONNX, checked against golden outputs, timed."""

__version__ = "0.1.0"


def export_module(module, example_inputs, **kwargs):
    """Exports your own attention module through attnexport's core: see `attnexport.export.export_module`."""
    from attnexport.export import export_module as export
    return export(module, example_inputs, **kwargs)


def verify_module(model_path, spec: str, runtimes=None, **kwargs):
    """Verifies a model file against the module it came from: see `attnexport.verify.verify_module`."""
    from attnexport.verify import verify_module as verify
    return verify(model_path, spec, runtimes, **kwargs)

"""`attnexport.stamping` on a user's module of alike layers (no transformers): `export_module` with a
`Repeat` traces three of the layers and stamps the rest, and the graph computes what the module does,
each layer on its own weights; a layer that differs from the one before leaves the whole trace."""

import contextlib

import numpy as np
import onnxruntime as ort
import pytest

torch = pytest.importorskip("torch")

from attnexport import stamping as ST  # noqa: E402
from attnexport.export import export_module  # noqa: E402

LAYERS = 6


class Block(torch.nn.Module):
    def __init__(self, width: int, act=torch.nn.functional.gelu):
        super().__init__()
        self.up, self.down, self.act = torch.nn.Linear(width, 2 * width), torch.nn.Linear(2 * width, width), act

    def forward(self, x):
        return x + self.down(self.act(self.up(x)))


class Stack(torch.nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.layers = torch.nn.ModuleList(blocks)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x * 2


def _repeat(module: Stack) -> ST.Repeat:
    @contextlib.contextmanager
    def shallow(traced):
        layers = traced.layers
        traced.layers = torch.nn.ModuleList(list(layers)[:ST.TRACED])
        try:
            yield
        finally:
            traced.layers = layers
    return ST.Repeat(len(module.layers), "layers", lambda i: [], shallow)


def _export(module, tmp_path, name):
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8)
    result = export_module(module.eval(), (x,), output=tmp_path / f"{name}.onnx", name=name, repeat=_repeat(module),
                           dynamic={"x": {0: "batch", 1: "sequence"}})
    feed = np.random.default_rng(1).standard_normal((3, 7, 8)).astype(np.float32)
    session = ort.InferenceSession(str(tmp_path / f"{name}.onnx"), providers=["CPUExecutionProvider"])
    with torch.no_grad():
        expected = module(torch.from_numpy(feed)).numpy()
    return result, session.run(None, {"x": feed})[0], expected


def test_alike_layers_are_traced_three_and_stamped(tmp_path):
    torch.manual_seed(0)
    module = Stack([Block(8) for _ in range(LAYERS)])
    result, got, expected = _export(module, tmp_path, "stack")
    assert f"traced with {ST.TRACED} of its {LAYERS} alike layers" in " ".join(result.notes)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)  # every layer's own weights, at new sizes
    assert len(module.layers) == LAYERS  # the module put back


def test_a_layer_unlike_the_one_before_leaves_the_whole_trace(tmp_path):
    torch.manual_seed(0)
    blocks = [Block(8) for _ in range(LAYERS)]
    blocks[ST.TEMPLATE] = Block(8, act=torch.relu)  # layer 2 computes otherwise than layer 1
    blocks[ST.TEMPLATE].load_state_dict(blocks[1].state_dict())
    module = Stack(blocks)
    result, got, expected = _export(module, tmp_path, "mixed")
    note = next(n for n in result.notes if n.startswith("traced with"))
    assert note.startswith(f"traced with all {LAYERS} layers: the traced layers are not alike (layer 1's ")
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)

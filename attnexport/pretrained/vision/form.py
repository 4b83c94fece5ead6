"""A vision transformer's one form, `image` (`attnexport.pretrained.forms`' class, registered by this
family): pixel values (batch, channels, height, width) of the size the model's image processor makes,
a dynamic batch, to each patch's state (`last_hidden_state`, the class token first) and the model's
pooled embedding (`pooler_output`: ViT's pooler, DINOv2's normalised class token); no cache."""

from __future__ import annotations

import contextlib
import inspect

import numpy as np
import torch

from attnexport.pretrained import forms as FM


class ImageStep(torch.nn.Module):
    """The model as its export: the patches' states and the pooled embedding of a batch of images of
    one size (height, width). Where the model's position table was made for another size, the model
    interpolates it on every call (DINOv2 always, bicubic; ViT when asked): here it is interpolated
    once, by the model's own code, and the graph holds the table at this size (a buffer, in the
    model's dtype). Pixel values in and the states out are float32 in every dtype (a half graph casts
    at its edges), as every client's processor makes and reads them."""

    def __init__(self, model, height: int, width: int):
        super().__init__()
        self.model = model
        self.kwargs: dict = {}
        self.register_buffer("positions", None, persistent=False)
        embeddings = getattr(model, "embeddings", None)
        table = getattr(embeddings, "position_embeddings", None)
        patch = int(model.config.patch_size)
        patches = (height // patch) * (width // patch)
        if embeddings is not None and isinstance(table, torch.nn.Parameter) and table.shape[1] - 1 != patches:
            if "interpolate_pos_encoding" in inspect.signature(model.forward).parameters:
                self.kwargs["interpolate_pos_encoding"] = True
            shaped = torch.zeros(1, patches + 1, table.shape[-1], dtype=table.dtype)
            with torch.no_grad():
                self.positions = embeddings.interpolate_pos_encoding(shaped, height, width).detach()

    def forward(self, pixel_values):
        # float32 in and out whatever the model's dtype: the pixel values its processor makes
        pixel_values = pixel_values.to(next(self.model.parameters()).dtype)
        if self.positions is None:
            out = self.model(pixel_values=pixel_values, **self.kwargs)
        else:
            embeddings = self.model.embeddings
            with _returning(embeddings, "interpolate_pos_encoding", self.positions):
                out = self.model(pixel_values=pixel_values, **self.kwargs)
        return out.last_hidden_state.float(), out.pooler_output.float()


@contextlib.contextmanager
def _returning(module, method: str, value):
    """`module.method(...)` returns `value` while inside."""
    setattr(module, method, lambda *args, **kwargs: value)
    try:
        yield
    finally:
        delattr(module, method)


class Image(FM.CacheForm):
    """One pass over a batch of images."""

    name = "image"
    kv_cache = False
    # (label, batch, ...): a check's images are its batch (no tokens, no cache).
    export_checks = (("batch 2 images", 2, 0, 0, 0), ("batch 1 image", 1, 0, 0, 0), ("batch 3 images", 3, 0, 0, 0))
    verify_checks = (("batch 4 images", 4, 0, 0, 0), ("batch 1 image", 1, 0, 0, 0))
    trace_shape = (0, 0)

    def inputs(self, layout):
        return ["pixel_values"]

    def outputs(self, layout):
        return ["last_hidden_state", "pooler_output"]

    def dynamic_axes(self, layout):
        return {"pixel_values": {0: "batch"}}

    def float32_inputs(self, layout):
        """The pixel values as the model's image processor makes them, in every dtype."""
        return ("pixel_values",)

    def wrapper(self, model, layout):
        return ImageStep(model, layout.extra["height"], layout.extra["width"])

    def rotary_positions(self, model, layout):
        return 0

    def check_room(self, layout, needs, what):
        """An image's patches are its positions: the model's size is the one it takes."""

    def example_feed(self, layout, batch, block, past, seed, padded):
        shape = (max(batch, 1), layout.extra["channels"], layout.extra["height"], layout.extra["width"])
        return {"pixel_values": np.random.default_rng(seed).standard_normal(shape).astype(np.float32)}

    def valid_positions(self, layout, feed):
        """Every patch's state and every image's embedding: an image has no padding."""
        batch = np.asarray(feed["pixel_values"]).shape[0]
        return {"last_hidden_state": np.ones((batch, 1, 1), bool), "pooler_output": np.ones((batch, 1), bool)}

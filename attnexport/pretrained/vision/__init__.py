"""Vision transformers (ViT, DINOv2 and their kin, as transformers' `ViTModel` and `Dinov2Model`):
an image's pixel values in (the model's image processor resizes and normalises them first, in the
client), each patch's state and the pooled embedding out, one graph of a dynamic batch (`form`, the
`image` form); judged as an image embedder's users judge it (`images`: each image's cosine to the
float64 embedding, top-k retrieval over a set of images the project draws), timed beside
transformers and Optimum's export (`bench`), embedded with by its clients (`clients`). The family
registers itself and its form.

The package's modules are imported when first read from it (most import torch and transformers)."""

from __future__ import annotations

import importlib

from attnexport.errors import UsageError
from attnexport.pretrained import forms as FM
from attnexport.pretrained import registry
from attnexport.pretrained import retrieval as RT


class VisionTransformer(registry.Family):
    """Vision transformers."""

    task = "image-feature-extraction"
    what = "vision transformer"
    architectures = ("ViTModel", "Dinov2Model")
    auto_class = "AutoModel"
    forms = ("image",)
    tested = ("vit", "dinov2")
    clients = ("optimum", "transformers.js")
    optimum_task = "feature-extraction"

    def form(self, name: str) -> FM.CacheForm:
        if name not in self.forms:
            raise UsageError(f"a {self.what} keeps no cache: --kv-cache and --max-seq do not apply")
        return FM.FORMS[name]

    def layout_fields(self, model, source) -> dict:
        """The images' size as the model's image processor makes them (its crop where it crops,
        else its resize; the model's own size where the folder has no processor), their channels and
        the patch size. The graph takes that size alone: where the model's position table was made
        for another (DINOv2's 518 crops to 224), the table interpolated to it is a constant of the
        graph (`form.ImageStep`), not the bicubic Resize ONNX Runtime refuses."""
        config = model.config
        height, width = self.module("images").input_size(source, config)
        return {"extra": {"height": height, "width": width, "channels": int(config.num_channels),
                          "patch_size": int(config.patch_size)}}

    def deploy_files(self, source) -> list[str]:
        """The image processor's preprocessor_config.json, which every client reads."""
        return ["preprocessor_config.json"]

    def check_feed(self, reference, tokenizer, batch, block, past, padded, seed) -> dict:
        return self.module("images").check_feed(reference.layout, batch, seed)

    def budget(self, text):
        """The file's precision's embedding budget (`retrieval.budget_for`), with `--budget
        cosine=...,retrieval=...` applied."""
        return RT.Overrides(text)

    def answer_rows(self, ctx, lossy: bool) -> None:
        self.module("check").embedding_rows(ctx)

    def client_rows(self, ctx) -> None:
        self.module("check").client_rows(ctx)

    def bench(self, source, told, said):
        return self.module("bench").from_options(source, told, said)

    def bench_lines(self, rows, info, title):
        return self.module("bench").lines(rows, info, title)


registry.register(VisionTransformer())
FM.register(importlib.import_module(f"{__name__}.form").Image())
__getattr__ = registry.lazy(__name__)

"""Small vision transformers from transformers' configs (random weights drawn from a seed, nothing
downloaded), saved as `save_pretrained` folders beside their image processor's
preprocessor_config.json, as a trained model's folder is: ViT (a class token, its patches, a pooler)
and DINOv2 (register-free, layer scale, its pooled output the normalised class token). What the suite
exports.

    python examples/tiny_vision.py vit tiny-vit          # 32 x 32 images, patches of 8, 2 layers, hidden 32
    python examples/tiny_vision.py dinov2 tiny-dinov2    # its position table for 56 x 56, its processor's crop 32
"""

import argparse

ARCHITECTURES = ("vit", "dinov2")


def config(arch: str, image_size: int = 32, patch: int = 8, hidden: int = 32, layers: int = 2, heads: int = 2):
    """The config of a small `arch` model for images of `image_size`. DINOv2's position table is made
    for a larger size (3 patches more a side), as the trained ones are (518, cropped to 224 by their
    processor): a model of it interpolates its table to the images it is given."""
    import transformers as T
    table = image_size + 3 * patch if arch == "dinov2" else image_size
    sizes = {"image_size": table, "patch_size": patch, "hidden_size": hidden, "num_hidden_layers": layers,
             "num_attention_heads": heads, "num_channels": 3}
    if arch == "dinov2":
        return T.Dinov2Config(mlp_ratio=4, architectures=["Dinov2Model"], **sizes)
    return T.ViTConfig(intermediate_size=hidden * 4, architectures=["ViTModel"], **sizes)


def processor(arch: str, image_size: int):
    """The image processor its users run: ViT's resizes to the image size and normalises by 0.5;
    DINOv2's (BitImageProcessor) resizes the shortest edge, crops the centre, normalises by
    ImageNet's mean and deviation."""
    import transformers as T
    if arch == "dinov2":
        return T.BitImageProcessor(size={"shortest_edge": image_size}, crop_size={"height": image_size,
                                                                                 "width": image_size},
                                   do_center_crop=True, image_mean=[0.485, 0.456, 0.406],
                                   image_std=[0.229, 0.224, 0.225])
    return T.ViTImageProcessor(size={"height": image_size, "width": image_size})


def save(arch: str, folder, seed: int = 0, **sizes) -> None:
    """The `arch` model's folder: config, weights drawn with torch seeded with `seed`, and its image
    processor's preprocessor_config.json."""
    import torch
    import transformers as T
    c = config(arch, **sizes)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = T.AutoModel.from_config(c, dtype=torch.float32)
    model.save_pretrained(str(folder))
    processor(arch, sizes.get("image_size", 32)).save_pretrained(str(folder))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("arch", choices=ARCHITECTURES)
    parser.add_argument("folder")
    for flag, default in (("image-size", 32), ("patch", 8), ("hidden", 32), ("layers", 2), ("heads", 2),
                          ("seed", 0)):
        parser.add_argument(f"--{flag}", type=int, default=default)
    a = parser.parse_args()
    save(a.arch, a.folder, seed=a.seed, image_size=a.image_size, patch=a.patch, hidden=a.hidden, layers=a.layers,
         heads=a.heads)
    print(f"wrote {a.folder} ({a.arch}, {a.image_size} x {a.image_size} images, patches of {a.patch}, "
          f"{a.layers} layers, hidden {a.hidden})")

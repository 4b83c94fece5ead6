"""The core of every encoder-decoder family (a composite model: an encoder graph and a decoder whose
two steps are merged after, Optimum's layout): the graphs' names, inputs and axes, the loops a
client writes and the merged decoder (`graphs`); the model's hooks a family fills, the float64
check of each graph before writing, quantization and the deployment folder (`export`); verify's
rows (`check`); what a lossy folder costs in answers and its budget (`cost`). A family gives its
graphs as torch modules and what its model reads and answers (Whisper: log-mel features and
transcripts; a text encoder-decoder: token ids and generated text).

The modules are imported when first read from the package (most import torch)."""

from attnexport.pretrained import registry

__getattr__ = registry.lazy(__name__)

"""A text encoder-decoder's deployment folder (`export --hf --deploy`) against the model it came from,
on every runtime, by the encoder-decoder core's verify (`attnexport.pretrained.encdec.check`: each
graph against the model in float64, the decode property, greedy outputs equal to transformers'
`generate` in fp32 token for token, a lossy folder's cost in outputs, the clients' outputs): what a
text model gives it is the project's texts (`texts.TEXTS`) tokenized by its own tokenizer into one
right-padded batch, transformers' greedy generation, and its clients (Optimum's
ORTModelForSeq2SeqLM, transformers.js' text2text-generation pipeline).
"""

from __future__ import annotations

import torch

from attnexport.errors import UsageError
from attnexport.pretrained import model as hf
from attnexport.pretrained import registry
from attnexport.pretrained.encdec import check as EC
from attnexport.pretrained.seq2seq import Text2Text
from attnexport.pretrained.seq2seq import clients as SC
from attnexport.pretrained.seq2seq import texts as T


class _Verify(EC.Verify):
    what = "a text encoder-decoder"

    def __init__(self):
        self.family = registry.of_task(Text2Text.task)

    def model_of(self, model, source):
        return T.TextModel.of(model, source)

    def inputs(self, m, check):
        return list(T.TEXTS), T.encoded(m.tok, T.TEXTS)

    def reference(self, m, feed, new_tokens):
        return reference_outputs(m, feed, new_tokens)

    def client_answers(self, client, folder, inputs, new_tokens, threads):
        return SC.generate(client, folder, inputs, new_tokens, threads)

    def refuse(self, check) -> None:
        if getattr(check, "audio", None):
            raise UsageError("--audio goes with a speech model; a text encoder-decoder is verified on the project's "
                             "texts")


def verify(check):
    """The rows of every check on every selected runtime (`check`: the verify request, an
    `attnexport.pretrained.check.HFCheck` whose model_path is the deployment folder)."""
    return EC.verify_graphs(check, _Verify())


def reference_outputs(m: T.TextModel, feed: dict, new_tokens: int) -> list[list[int]]:
    """transformers' own greedy `generate` in fp32 of the padded batch (the model's generation
    config: its bad words, its forced end token), each text's tokens after the start token, up to
    and without the end token."""
    with torch.no_grad(), hf.quiet_transformers():
        out = m.model.generate(input_ids=torch.from_numpy(feed["input_ids"]),
                               attention_mask=torch.from_numpy(feed["attention_mask"]), max_new_tokens=new_tokens,
                               do_sample=False, num_beams=1)
    return [SC.said(row, m.start, m.end) for row in out.tolist()]

"""What a lossy Whisper folder costs in transcripts: the encoder-decoder core's measure
(`attnexport.pretrained.encdec.cost`: teacher-forced KL and top-1 along fp32's transcripts, greedy
transcripts' token agreement and WER, near ties taken fp32's way) judged by the speech budget, whose
defaults are in docs/whisper.md with the measurements behind them."""

from __future__ import annotations

from dataclasses import dataclass

from attnexport.pretrained.encdec import cost as COST


@dataclass(frozen=True)
class SpeechBudget(COST.AnswerBudget):
    """The speech accuracy budget (`encdec.cost.AnswerBudget`'s limits), said of transcripts."""

    def with_overrides(self, text: str | None) -> SpeechBudget:
        return super().with_overrides(text)  # type: ignore[return-value]

    def text(self, answer: str = "transcript") -> str:
        return super().text(answer)

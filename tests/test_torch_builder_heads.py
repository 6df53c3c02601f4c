"""The torch builder on Hugging Face task heads other than the language-model ones: the
regression head (``num_labels=1``, MSE on float labels) that torch.onnx could not write
(``prims.view_of``), classification over sequences and tokens, and question answering;
each trained beside torch eager with the batch size changing (``ORTModule(builder="torch")``,
what stock ``onnxruntime`` gets).  Also the text torch.onnx's errors carry: no terminal
codes.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_module_conformance import fewer_on_training_build, train_side_by_side  # noqa: E402

from ortpass.training.joint_onnx import without_terminal_codes  # noqa: E402

pytestmark = pytest.mark.stock

VOCAB, SEQ = 100, 8


def _bert_config(**head) -> "transformers.BertConfig":
    return transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **head,
    )  # fmt: skip


def _labels(kind: str, batch: int, generator: torch.Generator) -> dict:
    if kind == "regression":
        return {"labels": torch.randn(batch, generator=generator)}
    if kind == "classes":
        return {"labels": torch.randint(0, 3, (batch,), generator=generator)}
    if kind == "multi_label":
        return {"labels": (torch.rand(batch, 3, generator=generator) < 0.5).float()}
    if kind == "tokens":
        return {"labels": torch.randint(0, 5, (batch, SEQ), generator=generator)}
    return {  # spans
        "start_positions": torch.randint(0, SEQ, (batch,), generator=generator),
        "end_positions": torch.randint(0, SEQ, (batch,), generator=generator),
    }


def _batches(kind: str, sizes=(2, 3, 4)):
    generator = torch.Generator().manual_seed(1)
    for batch in sizes:
        yield torch.randint(4, VOCAB, (batch, SEQ), generator=generator), _labels(kind, batch, generator)


HEADS = {
    "regression": lambda: transformers.BertForSequenceClassification(_bert_config(num_labels=1)),
    "classes": lambda: transformers.BertForSequenceClassification(_bert_config(num_labels=3)),
    "multi_label": lambda: transformers.BertForSequenceClassification(
        _bert_config(num_labels=3, problem_type="multi_label_classification")
    ),
    "tokens": lambda: transformers.BertForTokenClassification(_bert_config(num_labels=5)),
    "spans": lambda: transformers.BertForQuestionAnswering(_bert_config()),
}


def _loss(model, batch):
    ids, labels = batch
    return model(input_ids=ids, **labels).loss


@pytest.mark.slow
@pytest.mark.parametrize("kind", fewer_on_training_build(sorted(HEADS), ("regression",)))
def test_task_heads_train_like_torch(kind):
    torch.manual_seed(0)
    train_side_by_side(HEADS[kind](), _loss, _batches(kind), builder="torch")


def test_terminal_codes_are_stripped_from_error_text():
    coloured = "Failed. \x1b[96mThis is step 3/3\x1b[0m of exporting; the \x1b[1;31m*onnx*\x1b[m component"
    assert without_terminal_codes(coloured) == "Failed. This is step 3/3 of exporting; the *onnx* component"
    assert without_terminal_codes("plain [96m text") == "plain [96m text"  # no escape byte: kept

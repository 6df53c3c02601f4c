"""ORTModule inside Hugging Face's Trainer and accelerate, called as they call a model.

``Trainer(model=ORTModule(model), args=TrainingArguments(...))`` with default arguments
(``remove_unused_columns``, label names and loss kwargs found from the model) trains beside
the same Trainer over the bare model: the loss of every logged step, ``eval_loss``, a
checkpoint saved mid-training that ``from_pretrained`` reloads and ``resume_from_checkpoint``
continues from, with gradient accumulation normalized by ``num_items_in_batch`` and a short
last batch.  accelerate's ``prepare``/``unwrap_model``/``save_model``/``save_state``/
``load_state`` see what they see without the wrapper.
"""

from __future__ import annotations

import copy
import inspect
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from ortpass import ORTModule  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.stock]

VOCAB, SEQ = 96, 12


def _config(name: str):
    if name == "gpt2":  # dropout 0: ORT's dropout draws other masks than torch's
        return transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)  # fmt: skip
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, use_cache=False)  # fmt: skip


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(_config(name))


class _Texts(torch.utils.data.Dataset):
    """Token ids with padding labels (-100) at the end of some rows, and a column the
    model does not take (``remove_unused_columns`` drops it)."""

    def __init__(self, rows: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (rows, SEQ), generator=generator)
        self.lengths = torch.randint(SEQ // 2, SEQ + 1, (rows,), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        labels = self.ids[i].clone()
        labels[int(self.lengths[i]) :] = -100
        return {"input_ids": self.ids[i], "labels": labels, "text": f"row {i}"}


def _trainer(model, out, max_steps=4, **args) -> transformers.Trainer:
    arguments = transformers.TrainingArguments(
        output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=4, per_device_eval_batch_size=4,
        gradient_accumulation_steps=2, learning_rate=1e-3, logging_steps=1, save_steps=2, **args,
    )  # fmt: skip
    # 18 rows, batches of 4: an epoch ends on a short batch of 2 (steps of 2 batches).
    return transformers.Trainer(model=model, args=arguments, train_dataset=_Texts(18, 1), eval_dataset=_Texts(6, 2))


def _losses(trainer) -> list[float]:
    return [float(entry["loss"]) for entry in trainer.state.log_history if "loss" in entry]


def _assert_same_weights(a: torch.nn.Module, b: torch.nn.Module, tolerance: float = 1e-4) -> None:
    mine, theirs = a.state_dict(), b.state_dict()
    assert list(mine) == list(theirs)
    for name, value in mine.items():
        torch.testing.assert_close(value, theirs[name], rtol=tolerance, atol=tolerance, msg=name)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_trainer_with_default_arguments_trains_evaluates_and_checkpoints_like_torch(name, tmp_path):
    reference = _trainer(_model(name), tmp_path / "torch")
    reference.train()
    wrapped_model = ORTModule(_model(name), cache_dir=tmp_path / "graphs")  # the resumed run loads its graph
    trainer = _trainer(wrapped_model, tmp_path / "ort")
    trainer.train()

    losses, expected = _losses(trainer), _losses(reference)
    assert len(losses) == len(expected) == 4
    assert losses == pytest.approx(expected, rel=1e-4)
    assert trainer.model_accepts_loss_kwargs and trainer.label_names == ["labels"]
    _assert_same_weights(wrapped_model.module, reference.model)
    evaluation, expected_evaluation = trainer.evaluate(), reference.evaluate()
    assert evaluation["eval_loss"] == pytest.approx(expected_evaluation["eval_loss"], rel=1e-4)

    # The step-2 checkpoint: a model directory as torch's Trainer writes it (config, tied head).
    checkpoint, torch_checkpoint = tmp_path / "ort" / "checkpoint-2", tmp_path / "torch" / "checkpoint-2"
    assert json.loads((checkpoint / "config.json").read_text())["model_type"] == _config(name).model_type
    assert sorted(os.listdir(checkpoint)) == sorted(os.listdir(torch_checkpoint))
    _assert_same_weights(transformers.AutoModelForCausalLM.from_pretrained(checkpoint),
                         transformers.AutoModelForCausalLM.from_pretrained(torch_checkpoint))  # fmt: skip

    # Resumed from it in a new Trainer over a new wrapper: the same last two steps.
    resumed_model = ORTModule(_model(name), cache_dir=tmp_path / "graphs")
    resumed = _trainer(resumed_model, tmp_path / "ort")
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert _losses(resumed)[-2:] == pytest.approx(expected[-2:], rel=1e-4)
    assert resumed_model.graph_builds == 0, resumed_model.transitions.transitions
    _assert_same_weights(resumed_model.module, reference.model)


def test_trainer_sees_the_model_through_the_wrapper():
    model = _model("llama")
    wrapped = ORTModule(model)
    assert isinstance(wrapped, transformers.LlamaForCausalLM) and isinstance(wrapped, ORTModule)
    assert type(wrapped) is ORTModule and repr(wrapped).startswith("ORTModule(")
    assert inspect.signature(wrapped.forward) == inspect.signature(model.forward)
    assert wrapped.config is model.config and wrapped.generation_config is model.generation_config
    assert wrapped.get_input_embeddings() is model.get_input_embeddings()
    assert wrapped.num_parameters() == model.num_parameters()
    assert (wrapped.device, wrapped.dtype) == (model.device, model.dtype)
    assert wrapped.loss_type == model.loss_type
    with pytest.raises(AttributeError, match="no_such_attribute"):
        wrapped.no_such_attribute  # noqa: B018
    # Not forwarded: the wrapper's own and Python's protocol names.
    assert not hasattr(wrapped, "__deepcopy__") and wrapped.training == model.training


def test_generate_runs_the_wrapped_model_in_torch():
    model = _model("gpt2").eval()
    wrapped = ORTModule(model)
    ids = torch.randint(0, VOCAB, (2, 5))
    expected = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(wrapped.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0), expected)


def test_save_pretrained_round_trip_keeps_the_tied_head(tmp_path):
    wrapped = ORTModule(_model("gpt2"))
    wrapped(input_ids=torch.randint(0, VOCAB, (2, SEQ)), labels=torch.randint(0, VOCAB, (2, SEQ))).loss.backward()
    wrapped.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    _assert_same_weights(loaded, wrapped.module, 0.0)
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()


def test_state_dict_round_trips_between_wrapped_and_bare_models():
    bare, other = _model("llama"), _model("llama")
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    wrapped = ORTModule(other)
    assert list(wrapped.state_dict()) == list(bare.state_dict())
    bare.load_state_dict(wrapped.state_dict())
    _assert_same_weights(bare, other, 0.0)
    fresh = ORTModule(_model("llama"))
    fresh.load_state_dict(bare.state_dict())
    _assert_same_weights(fresh.module, other, 0.0)
    # Checkpoints ortpass wrote before: module.-prefixed keys.
    legacy = ORTModule(_model("llama"))
    legacy.load_state_dict({f"module.{k}": v for k, v in other.state_dict().items()})
    _assert_same_weights(legacy.module, other, 0.0)
    result = legacy.load_state_dict({k: v for k, v in other.state_dict().items() if "norm" not in k}, strict=False)
    assert result.missing_keys and all(not k.startswith("module.") for k in result.missing_keys)


def test_state_dict_of_a_wrapper_inside_a_torch_model():
    def outer(inner: torch.nn.Module) -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(4, 4), inner)

    torch.manual_seed(0)
    bare = outer(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)))
    wrapped = outer(ORTModule(copy.deepcopy(bare[1])))
    assert list(wrapped.state_dict()) == list(bare.state_dict())
    with torch.no_grad():
        for p in bare.parameters():
            p.mul_(2.0)
    wrapped.load_state_dict(bare.state_dict())
    _assert_same_weights(wrapped, bare, 0.0)


def test_a_module_with_its_own_child_named_module_keeps_the_prefix():
    class Holder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = torch.nn.Linear(3, 2)

        def forward(self, x):
            return self.module(x)

    wrapped = ORTModule(Holder())
    assert list(wrapped.state_dict()) == ["module.module.weight", "module.module.bias"]
    copy_of = ORTModule(Holder())
    copy_of.load_state_dict(wrapped.state_dict())
    _assert_same_weights(copy_of, wrapped, 0.0)


def test_resize_token_embeddings_builds_a_graph_for_the_new_shapes():
    model = _model("llama")
    wrapped = ORTModule(model)
    ids = torch.randint(0, VOCAB, (2, SEQ))
    wrapped(input_ids=ids, labels=ids).loss.backward()
    wrapped.zero_grad()  # as a loop does after its step: the old gradients have the old shapes
    wrapped.resize_token_embeddings(VOCAB + 8)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB + 8, (2, SEQ))
    loss = wrapped(input_ids=ids, labels=ids).loss
    assert loss.item() == pytest.approx(reference(input_ids=ids, labels=ids).loss.item(), rel=1e-5)
    assert wrapped.graph_builds == 2
    assert "shape" in wrapped.transitions.transitions[-1][1]


def test_pickling_and_copies_keep_the_wrapper(tmp_path):
    wrapped = ORTModule(_model("gpt2"))
    torch.save(wrapped, tmp_path / "whole.pt")
    loaded = torch.load(tmp_path / "whole.pt", weights_only=False)
    assert type(loaded) is ORTModule and type(copy.deepcopy(wrapped)) is ORTModule
    _assert_same_weights(loaded.module, wrapped.module, 0.0)


def test_accelerate_prepares_unwraps_saves_and_restores_like_the_bare_model(tmp_path):
    import accelerate

    def run(model, where):
        accelerator = accelerate.Accelerator(gradient_accumulation_steps=2, cpu=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        data = torch.utils.data.DataLoader(_Texts(12, 3), batch_size=3)
        model, optimizer, data = accelerator.prepare(model, optimizer, data)
        losses = []
        for batch in data:
            with accelerator.accumulate(model):
                loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(loss.item())
        accelerator.save_model(model, where / "model")
        accelerator.save_state(where / "state")
        return accelerator, model, losses

    accelerator_t, reference, expected = run(_model("gpt2"), tmp_path / "torch")
    accelerator_o, wrapped, losses = run(ORTModule(_model("gpt2")), tmp_path / "ort")
    assert losses == pytest.approx(expected, rel=1e-4)
    unwrapped = accelerator_o.unwrap_model(wrapped)
    assert isinstance(unwrapped, transformers.GPT2LMHeadModel)
    assert list(unwrapped.state_dict()) == list(accelerator_t.unwrap_model(reference).state_dict())
    assert sorted(os.listdir(tmp_path / "ort" / "model")) == sorted(os.listdir(tmp_path / "torch" / "model"))
    import safetensors.torch

    saved = safetensors.torch.load_file(tmp_path / "ort" / "model" / "model.safetensors")
    assert set(saved) == set(safetensors.torch.load_file(tmp_path / "torch" / "model" / "model.safetensors"))
    # load_state into a fresh wrapper restores the weights.
    fresh = ORTModule(_model("gpt2"))
    accelerator = accelerate.Accelerator(cpu=True)
    fresh = accelerator.prepare(fresh)
    accelerator.load_state(tmp_path / "ort" / "state")
    _assert_same_weights(fresh.module, wrapped.module, 0.0)


def test_peft_around_the_wrapper_trains_its_adapters_like_torch():
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    wrapped = peft.get_peft_model(ORTModule(_model("llama")), copy.deepcopy(config))
    reference = peft.get_peft_model(_model("llama"), config)
    reference.load_state_dict(wrapped.state_dict())  # the same adapters, under the same keys
    optimizers = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in (wrapped, reference)]
    generator = torch.Generator().manual_seed(3)
    for batch, seq in [(2, SEQ), (3, SEQ - 2), (2, SEQ)]:
        ids = torch.randint(0, VOCAB, (batch, seq), generator=generator)
        losses = [m(input_ids=ids, labels=ids).loss for m in (wrapped, reference)]
        assert losses[0].item() == pytest.approx(losses[1].item(), rel=1e-5)
        for loss, optimizer in zip(losses, optimizers):
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    _assert_same_weights(wrapped, reference)


def test_a_config_that_returns_the_key_value_cache_is_refused_with_the_setting_to_change():
    from ortpass.errors import OrtpassError

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # use_cache=True, its default
    wrapped = ORTModule(transformers.GPT2LMHeadModel(config))
    ids = torch.randint(0, VOCAB, (2, SEQ))
    with pytest.raises(OrtpassError, match=r"model\.config\.use_cache = False"):
        wrapped(input_ids=ids, labels=ids)
    wrapped.config.use_cache = False  # the wrapper's config is the model's
    assert wrapped(input_ids=ids, labels=ids).loss.item() == pytest.approx(
        wrapped.module(input_ids=ids, labels=ids).loss.item(), rel=1e-5)  # fmt: skip

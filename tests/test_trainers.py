"""autosac inside real trainers: transformers' Trainer (with and without a
peft LoRA adapter) and Lightning.  Each run with a plan is compared with the
same run without one: the losses and the trained parameters bitwise equal, and
the peak measured over the whole run (profiler allocator events, plus what
was alive before it) within the plan's budget."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from autosac.allocations import AllocationCounter
from autosac.measure import _storage_bytes

transformers = pytest.importorskip("transformers")


def tiny_llama(dropout: float = 0.1):
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   attention_dropout=dropout, attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, n: int = 32, seq: int = 64):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 128, (n, seq), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class PeakOfTraining(transformers.TrainerCallback):
    """The peak from the first step on (after any planning): the bytes alive
    when training begins plus the most the allocator held above them."""

    def __init__(self):
        self.counter, self.peak = AllocationCounter(), None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.alive = _storage_bytes(list(model.parameters()) + list(model.buffers()))
        self.counter.start()

    def on_train_end(self, args, state, control, **kwargs):
        peak, _ = self.counter.stop()
        self.peak = self.alive + peak


def run_trainer(model, tmp_path, callbacks=(), steps: int = 4, **args):
    """Train for ``steps``; return the losses each step returned, the trained
    parameters and the measured peak (:class:`PeakOfTraining`)."""

    class Recording(transformers.Trainer):
        losses: list = []

        def training_step(self, *a, **k):
            loss = super().training_step(*a, **k)
            self.losses.append(loss.clone())
            return loss

    settings = dict(output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=8, learning_rate=1e-2,
                    logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
                    dataloader_num_workers=0, disable_tqdm=True)
    settings.update(args)
    peak = PeakOfTraining()  # after the callbacks given: it counts from after their on_train_begin
    trainer = Recording(model=model, args=transformers.TrainingArguments(**settings), train_dataset=TokenDataset(),
                        callbacks=[*callbacks, peak])
    Recording.losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return list(Recording.losses), params, peak.peak


def assert_same_training(ref, got):
    assert len(ref[0]) == len(got[0])
    assert all(torch.equal(a, b) for a, b in zip(ref[0], got[0])), (ref[0], got[0])
    assert ref[1].keys() == got[1].keys()
    assert all(torch.equal(ref[1][k], got[1][k]) for k in ref[1])


def lora(model):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    torch.manual_seed(2)  # the adapters' initial weights: the same for each run compared
    return peft.get_peft_model(model, config)


@pytest.mark.parametrize("adapter", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("args", [{}, {"bf16": True}, {"gradient_accumulation_steps": 2}],
                         ids=["fp32", "bf16", "accum2"])
def test_hf_trainer_with_a_plan_trains_bitwise_the_same_within_budget(tmp_path, adapter, args):
    from autosac.trainers.hf import AutosacCallback

    base = tiny_llama()
    make = (lambda: lora(copy.deepcopy(base))) if adapter else (lambda: copy.deepcopy(base))
    ref = run_trainer(make(), tmp_path, **args)
    callback = AutosacCallback("60%")
    got = run_trainer(make(), tmp_path, callbacks=[callback], **args)
    plan = callback.plan
    assert plan is not None and plan.decisions
    assert plan.output_held is False and plan.target == "cpu"
    assert plan.autocast == ("bfloat16" if args.get("bf16") else "")
    assert plan.grad_accumulation == args.get("gradient_accumulation_steps", 1)
    assert_same_training(ref, got)
    assert got[2] <= plan.budget_bytes, (got[2], plan.budget_bytes, ref[2])
    assert got[2] < ref[2]


def test_hf_trainer_gradient_checkpointing_is_replaced_in_one_line(tmp_path):
    from autosac.trainers.hf import AutosacCallback

    callback = AutosacCallback("least")
    model = tiny_llama()
    with pytest.warns(UserWarning, match="turned transformers' gradient checkpointing off"):
        trainer = transformers.Trainer(
            model=model, train_dataset=TokenDataset(), callbacks=[callback],
            args=transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=8,
                                                report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
                                                gradient_checkpointing=True))
        trainer.train()
    assert callback.plan.decisions and not model.is_gradient_checkpointing


def test_hf_trainer_infeasible_budget_stops_before_the_first_step(tmp_path):
    import autosac
    from autosac.applier import applied_plan
    from autosac.trainers.hf import AutosacCallback

    model = tiny_llama()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = transformers.Trainer(
        model=model, train_dataset=TokenDataset(), callbacks=[AutosacCallback("1KiB")],
        args=transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=8,
                                            report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True))
    with pytest.raises(autosac.InfeasibleBudgetError, match="least reachable peak"):
        trainer.train()
    assert applied_plan(model) is None
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())

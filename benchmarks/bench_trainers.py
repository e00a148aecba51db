"""Each trainer's own checkpointing switch against autosac at the same memory,
measured side by side on this CPU.

  transformers Trainer   gradient_checkpointing=True  vs  AutosacCallback(<its peak>)   full and LoRA
  Lightning              model.gradient_checkpointing_enable() in configure_model  vs  AutosacCallback(<its peak>)
  torchtitan (debug)     activation_checkpoint full / selective op / selective every 2nd layer
                         vs  autosac planned for each one's peak (torchtitan's trainer needs its datasets and
                         tokenizer, not here: the model is stepped by autosac.measure)

The peak is measured from the first training step on (profiler allocator
events plus what was alive before: parameters, buffers); the step time is the
median over the timed steps of ``rounds`` interleaved runs.  autosac's budget
is the other's measured peak, in bytes.

    python benchmarks/bench_trainers.py [rounds]
"""

from __future__ import annotations

import copy
import statistics
import sys
import tempfile
import time
import warnings

import torch

import autosac
from autosac.core.allocations import AllocationCounter
from autosac.tools.measure import _storage_bytes

STEPS, WARM = 8, 2  # steps per run, of which the first WARM are not timed
LLAMA = dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=256)
BATCH, SEQ = 8, 256


def llama():
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))


def with_lora(model):
    import peft

    torch.manual_seed(2)
    return peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int):
        self.ids = torch.randint(0, LLAMA["vocab_size"], (n, SEQ), generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Watch:
    """Peak from the first step on, and each step's wall time."""

    def __init__(self):
        self.counter, self.times, self.peak = AllocationCounter(), [], None

    def begin(self, model):
        self.alive = _storage_bytes(list(model.parameters()) + list(model.buffers()))
        self.counter.start()

    def step_start(self):
        self.t0 = time.perf_counter()

    def step_end(self):
        self.times.append((time.perf_counter() - self.t0) * 1e3)

    def end(self):
        self.peak = self.alive + self.counter.stop()[0]


def hf_run(model, callbacks=(), **args) -> Watch:
    import transformers

    watch = Watch()

    class Hooks(transformers.TrainerCallback):
        def on_train_begin(self, a, s, c, model=None, **k):
            watch.begin(model)

        def on_step_begin(self, *a, **k):
            watch.step_start()

        def on_step_end(self, *a, **k):
            watch.step_end()

        def on_train_end(self, *a, **k):
            watch.end()

    with tempfile.TemporaryDirectory() as out:
        settings = transformers.TrainingArguments(
            output_dir=out, max_steps=STEPS, per_device_train_batch_size=BATCH, learning_rate=1e-3,
            save_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True, logging_strategy="no", **args)
        trainer = transformers.Trainer(model=model, args=settings, train_dataset=Tokens(BATCH * STEPS),
                                       callbacks=[*callbacks, Hooks()])
        trainer.train()
    return watch


def lightning_run(model, callbacks=(), checkpoint_layers: bool = False) -> Watch:
    import lightning as L

    watch = Watch()

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model

        def configure_model(self):
            if checkpoint_layers:  # Lightning's way: the model's own switch, where the model is set up
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class Hooks(L.Callback):
        def on_train_start(self, trainer, module):
            watch.begin(module)

        def on_train_batch_start(self, *a):
            watch.step_start()

        def on_train_batch_end(self, *a):
            watch.step_end()

        def on_train_end(self, *a):
            watch.end()

    trainer = L.Trainer(accelerator="cpu", max_steps=STEPS, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[*callbacks, Hooks()])
    L.seed_everything(0, verbose=False)
    trainer.fit(Module(), torch.utils.data.DataLoader(Tokens(BATCH * STEPS), batch_size=BATCH, shuffle=True))
    return watch


def rounds_of(runs: dict, rounds: int) -> dict:
    """``{name: (peak, median step ms)}``: each run ``rounds`` times, interleaved."""
    times = {k: [] for k in runs}
    peaks = {}
    for _ in range(rounds):
        for k, run in runs.items():
            w = run()
            times[k] += w.times[WARM:]
            peaks[k] = w.peak
    return {k: (peaks[k], statistics.median(times[k])) for k in runs}


def table(title: str, rows: dict, pairs: list[tuple[str, str]], lines: dict) -> None:
    base_ms = rows["none"][1]
    print(f"\n{title}\n")
    print("| variant | peak MiB | step ms | x none | user code |")
    print("|---|---:|---:|---:|---|")
    for k, (peak, ms) in rows.items():
        print(f"| {k} | {peak / 2**20:.2f} | {ms:.1f} | {ms / base_ms:.2f} | {lines.get(k, '-')} |")
    for theirs, ours in pairs:
        (tp, tm), (op, om) = rows[theirs], rows[ours]
        print(f"{ours} against {theirs}: peak {op / 2**20:.2f} vs {tp / 2**20:.2f} MiB "
              f"({'within' if op <= tp else 'OVER'}), step {om / tm:.2f}x")


def bench_hf(rounds: int, lora: bool) -> None:
    from autosac.trainers.hf import AutosacCallback

    base = llama()
    make = (lambda: with_lora(copy.deepcopy(base))) if lora else (lambda: copy.deepcopy(base))
    gc = hf_run(make(), gradient_checkpointing=True).peak  # the switch's memory, for autosac's budget
    runs = {"none": lambda: hf_run(make()),
            "gradient_checkpointing=True": lambda: hf_run(make(), gradient_checkpointing=True),
            "autosac at that peak": lambda: hf_run(make(), callbacks=[AutosacCallback(gc)])}
    lines = {"gradient_checkpointing=True": "1 line: TrainingArguments(gradient_checkpointing=True)",
             "autosac at that peak": "2 lines: import; callbacks=[AutosacCallback(budget)]"}
    table(f"transformers Trainer, Llama {LLAMA['num_hidden_layers']}x{LLAMA['hidden_size']}, batch {BATCH}x{SEQ}, "
          f"{'LoRA r=8 on q,v (peft)' if lora else 'full fine-tune'}, AdamW",
          rounds_of(runs, rounds), [("gradient_checkpointing=True", "autosac at that peak")], lines)


def bench_lightning(rounds: int) -> None:
    from autosac.trainers.lightning import AutosacCallback

    base = llama()
    gc = lightning_run(copy.deepcopy(base), checkpoint_layers=True).peak
    runs = {"none": lambda: lightning_run(copy.deepcopy(base)),
            "gradient_checkpointing_enable()": lambda: lightning_run(copy.deepcopy(base), checkpoint_layers=True),
            "autosac at that peak": lambda: lightning_run(copy.deepcopy(base), callbacks=[AutosacCallback(gc)])}
    lines = {"gradient_checkpointing_enable()": "1 line in configure_model",
             "autosac at that peak": "2 lines: import; callbacks=[AutosacCallback(budget)]"}
    table(f"Lightning, the same Llama in a LightningModule, batch {BATCH}x{SEQ}, AdamW", rounds_of(runs, rounds),
          [("gradient_checkpointing_enable()", "autosac at that peak")], lines)


def bench_titan(rounds: int) -> None:
    from torchtitan.config.job_config import ActivationCheckpoint
    from torchtitan.distributed.activation_checkpoint import apply_ac
    from torchtitan.models.llama3 import Transformer, llama3_args

    from autosac.trainers.titan import titan_loss

    torch.manual_seed(0)
    model = Transformer(llama3_args["debugmodel"])
    with torch.no_grad():
        model.init_weights()
    tokens = torch.randint(0, 2048, (8, 512))
    loop = dict(loss_fn=titan_loss, output_held=False)
    variants = {"none": model}
    for label, mode, option in (("full", "full", "2"), ("selective op", "selective", "op"),
                                ("selective every 2nd layer", "selective", "2")):
        m = copy.deepcopy(model)
        apply_ac(m, ActivationCheckpoint(mode=mode, selective_ac_option=option))
        variants[label] = m
    stats = autosac.profile(model, tokens, target="cpu", **loop)
    pairs = []
    for label in list(variants)[1:]:
        peak = autosac.measure(variants[label], tokens, steps=1, **loop).peak_bytes
        try:
            plan = autosac.solve(stats, peak)
        except autosac.InfeasibleBudgetError:  # at autosac's least peak, predicted a few bytes over
            plan = autosac.solve(stats, "least")
        variants[f"autosac at {label}'s peak"] = autosac.apply(copy.deepcopy(model), plan)
        pairs.append((label, f"autosac at {label}'s peak"))
    rows = {k: [] for k in variants}
    peaks = {}
    for _ in range(rounds):
        for k, m in variants.items():
            got = autosac.measure(m, tokens, steps=STEPS - WARM, **loop)
            rows[k] += got.step_ms_all
            peaks[k] = got.peak_bytes
    lines = {"full": "config: activation_checkpoint.mode = full",
             "selective op": "config: mode = selective, selective_ac_option = op",
             "selective every 2nd layer": "config: mode = selective, selective_ac_option = 2"}
    for k in variants:
        if k.startswith("autosac"):
            lines[k] = "config: model.converters = [autosac], [autosac] budget"
    table("torchtitan Llama 3 debug model (6 x 256, vocab 2048), batch 8x512, AdamW, stepped by autosac.measure",
          {k: (peaks[k], statistics.median(v)) for k, v in rows.items()}, pairs, lines)


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    print(f"{rounds} rounds, {STEPS - WARM} timed steps per run, one CPU thread")
    bench_hf(rounds, lora=False)
    bench_hf(rounds, lora=True)
    bench_lightning(rounds)
    bench_titan(rounds)


if __name__ == "__main__":
    main()

"""Worker of benchmarks/trainer_overhead.py: one rank of a 2-process job that trains the same plan,
model and data with `ActCompTrainer` and with a plain loop over `Pipeline.train_step`, in
`--rounds` rounds of alternating order per mode (interleaved blocks in one Trainer run, or whole
separate runs), and writes every rank's step marks to `--out` (JSON, from rank 0).

Both methods mark an optimizer step's end the same way, on every rank (the loop: after `zero_grad`;
the Trainer: its `on_step_end` callback, called after the same optimizer, scheduler and
`zero_grad` calls, so whatever Trainer does after a step, such as logging, lands in the next
interval): the wall clock and the process's CPU seconds (less the spans the method was paused),
and the seconds spent so far in each timed part: inside `Pipeline.train_step` and
`clip_grad_norm_` (the shared work), so that what is left per step is each method's own overhead,
and in the parts of that overhead (data, optimizer, schedule, zero_grad; the Trainer's logging,
its `comm/*` statistics, callbacks, flop count); and process-wide counters (system CPU time, page
faults, garbage collection).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import resource
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    TrainerCallback,
    TrainingArguments,
    default_data_collator,
    get_scheduler,
)

import hf_actcomp
from hf_actcomp.data import build_tokenizer, causal_lm_datasets, offline_corpus

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import wait_until_quiet  # noqa: E402

METHODS = ("loop", "trainer")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--link", default="loopback", help="(launch.run_workers passes it; always loopback here)")
    p.add_argument("--spec", required=True, help="JSON: the settings of trainer_overhead.py")
    return p.parse_args(argv)


def build_data(spec: dict):
    texts = offline_corpus()
    tokenizer = build_tokenizer(texts, vocab_size=spec["vocab"])
    train, _ = causal_lm_datasets(tokenizer, texts, seq_len=spec["seq_len"], max_train_samples=spec["train_samples"])
    return tokenizer, train


def build_model(spec: dict, tokenizer):
    """The small random GPT-2 of recipes/finetune_gpt2.py (`offline-gpt2`), the same on every rank."""
    torch.manual_seed(spec["seed"])
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=spec["seq_len"], n_embd=spec["hidden"],
                        n_layer=spec["layers"], n_head=4, bos_token_id=tokenizer.bos_token_id,
                        eos_token_id=tokenizer.eos_token_id)
    return AutoModelForCausalLM.from_config(config)


def build_plan(spec: dict, num_samples: int) -> hf_actcomp.Plan:
    data = dict(spec["plan"])
    data["memory"] = {**data.get("memory", {}), "num_samples": num_samples}
    return hf_actcomp.Plan.from_dict(data)


class Clock:
    """One method's marks at every step end on this rank: its active wall clock and process CPU
    seconds (less the spans it was paused, while the other method ran), and the seconds spent so
    far in each timed part (`wrap`): `shared` is the pipeline's `train_step` and `clip_grad_norm_`,
    the work both methods share; the others are each method's own."""

    def __init__(self, paused: bool = False) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.seconds: dict[str, float] = {}
        self.parts: dict[str, list[float]] = {}
        self.nested: list[float] = []  # the time of timed calls inside each running timed call
        self.process: dict[str, list[float]] = {}  # process-wide counters at each mark (not paused)
        self.off = [0.0, 0.0]  # wall and CPU seconds paused so far
        self.paused_at = self._now() if paused else None

    @staticmethod
    def _now() -> tuple[float, float]:
        return time.perf_counter(), time.process_time()

    def pause(self) -> None:
        self.paused_at = self._now()

    def resume(self) -> None:
        """Leave the paused span out of every figure, the timed call it happened inside included."""
        now = self._now()
        for i in range(2):
            self.off[i] += now[i] - self.paused_at[i]
        if self.nested:
            self.nested[-1] += now[0] - self.paused_at[0]
        self.paused_at = None

    def wrap(self, obj, name: str, part: str) -> None:
        """Time every call of `obj.name` (an instance attribute shadows the method) into `part`,
        less the time of timed calls nested in it (a callback inside logging counts once)."""
        inner = getattr(obj, name)
        self.seconds.setdefault(part, 0.0)
        nested = self.nested

        def timed(*args, **kwargs):
            start = time.perf_counter()
            nested.append(0.0)
            try:
                return inner(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                self.seconds[part] += elapsed - nested.pop()
                if nested:
                    nested[-1] += elapsed

        setattr(obj, name, timed)

    def mark(self) -> None:
        wall, cpu = self._now()
        self.wall.append(wall - self.off[0])
        self.cpu.append(cpu - self.off[1])
        for part, seconds in self.seconds.items():
            self.parts.setdefault(part, []).append(seconds)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        for name, value in (("gc", GC.seconds), ("system", usage.ru_stime), ("faults", usage.ru_minflt)):
            self.process.setdefault(name, []).append(value)

    def marks(self) -> dict:
        return {"wall": self.wall, "cpu": self.cpu, "parts": self.parts, "process": self.process}


class GarbageCollection:
    """The seconds this process has spent in Python's garbage collector (`gc.callbacks`)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.started = 0.0
        gc.callbacks.append(self.callback)

    def callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self.started


GC = GarbageCollection()


class Loop:
    """The hand-written loop: the same optimizer (TrainingArguments' default, fused AdamW),
    schedule and clipping as the Trainer's arguments. `run(n)` trains n more steps."""

    def __init__(self, spec: dict, tokenizer, train, clock: Clock) -> None:
        self.spec = spec
        self.clock = clock
        self.pipe = pipe = hf_actcomp.prepare(build_model(spec, tokenizer), build_plan(spec, len(train)),
                                              timeout=spec["timeout"])
        params = [p for p in pipe.stage.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=spec["lr"], betas=(0.9, 0.999), eps=1e-8, fused=True)
        self.scheduler = get_scheduler("linear", self.optimizer, num_warmup_steps=spec["warmup_steps"],
                                       num_training_steps=spec["steps"])
        self.loader = DataLoader(train.with_format("torch"), batch_size=spec["batch_size"], shuffle=True,
                                 collate_fn=default_data_collator, drop_last=True,
                                 generator=torch.Generator().manual_seed(spec["seed"]))
        self.epoch = iter(self.loader)
        self.done = 0
        for name in ("train_step", "clip_grad_norm_"):
            clock.wrap(pipe, name, "shared")
        clock.wrap(self.optimizer, "step", "optimizer")  # around the schedule's own wrapper, which still runs
        clock.wrap(self.scheduler, "step", "scheduler")
        clock.wrap(pipe.stage, "zero_grad", "zero_grad")
        clock.wrap(self, "next_batch", "data")

    def next_batch(self) -> dict:
        try:
            return next(self.epoch)
        except StopIteration:
            self.epoch = iter(self.loader)
            return next(self.epoch)

    def run(self, n: int) -> None:
        for _ in range(min(n, self.spec["steps"] - self.done)):
            batch = self.next_batch()
            self.pipe.train_step(batch)
            self.pipe.clip_grad_norm_(self.spec["max_grad_norm"])
            self.optimizer.step()
            self.scheduler.step()
            self.pipe.stage.zero_grad()
            self.done += 1
            self.clock.mark()


class StepEnds(TrainerCallback):
    """Marks the Trainer's clock at every step end; at the start of training, times the optimizer
    and schedule Trainer has just built. Interleaved: every `block` Trainer steps (and, with
    `loop_first`, before the first), `block` steps of the loop, with the Trainer's clock paused."""

    def __init__(self, clock: Clock, loop: Loop | None = None, block: int = 0, loop_first: bool = False) -> None:
        self.clock = clock
        self.loop = loop
        self.block = block
        self.loop_first = loop_first

    def run_loop(self) -> None:
        self.clock.pause()
        self.loop.clock.resume()
        self.loop.run(self.block)
        self.loop.clock.pause()
        self.clock.resume()

    def on_train_begin(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
        self.clock.wrap(optimizer, "step", "optimizer")
        self.clock.wrap(lr_scheduler, "step", "scheduler")
        if self.loop is not None and self.loop_first:
            self.run_loop()

    def on_step_end(self, args, state, control, **kwargs):
        self.clock.mark()
        if self.loop is not None and state.global_step % self.block == 0:
            self.run_loop()


def run_trainer(spec: dict, tokenizer, train, output_dir: str, loop: Loop | None = None,
                loop_first: bool = False) -> Clock:
    model = build_model(spec, tokenizer)
    args = TrainingArguments(
        output_dir=output_dir, max_steps=spec["steps"], per_device_train_batch_size=spec["batch_size"],
        gradient_accumulation_steps=1, learning_rate=spec["lr"], warmup_steps=spec["warmup_steps"],
        lr_scheduler_type="linear", max_grad_norm=spec["max_grad_norm"], logging_steps=spec["logging_steps"],
        eval_strategy="no", save_strategy="no", report_to="none", use_cpu=True, dataloader_drop_last=True,
        seed=spec["seed"], disable_tqdm=not spec["tqdm"],
    )
    clock = Clock()
    trainer = hf_actcomp.ActCompTrainer(model=model, args=args, plan=build_plan(spec, len(train)),
                                        train_dataset=train, data_collator=default_data_collator,
                                        processing_class=tokenizer, timeout=spec["timeout"],
                                        callbacks=[StepEnds(clock, loop, spec["block"], loop_first)])
    for name in ("train_step", "clip_grad_norm_"):
        clock.wrap(trainer.pipe, name, "shared")
    clock.wrap(trainer.pipe, "zero_grad", "zero_grad")  # Trainer zeroes the model it wrapped: the pipeline
    for name, part in (("get_batch_samples", "data"), ("_maybe_log_save_evaluate", "logging"),
                       ("communication_logs", "comm_logs"), ("floating_point_ops", "flops")):
        clock.wrap(trainer, name, part)
    clock.wrap(trainer.callback_handler, "call_event", "callbacks")
    dist.barrier()
    trainer.train()
    return clock


def run_round(spec: dict, tokenizer, train, output_dir: str, mode: str, k: int) -> dict[str, Clock]:
    """One round: `separate`, the two methods one after the other (the loop first in even rounds);
    `interleaved`, one Trainer run with blocks of loop steps between its steps (the loop's block
    first in odd rounds)."""
    if mode == "interleaved":
        loop = Loop(spec, tokenizer, train, Clock(paused=True))
        trainer = run_trainer(spec, tokenizer, train, output_dir, loop, loop_first=k % 2 == 1)
        return {"loop": loop.clock, "trainer": trainer}
    clocks = {}
    for method in (METHODS if k % 2 == 0 else METHODS[::-1]):
        wait_for_quiet(spec)
        if method == "loop":
            loop = Loop(spec, tokenizer, train, Clock())
            dist.barrier()
            loop.run(spec["steps"])
            clocks[method] = loop.clock
        else:
            clocks[method] = run_trainer(spec, tokenizer, train, output_dir)
        reset_accelerate()
    return clocks


def wait_for_quiet(spec: dict) -> None:
    if spec["quiet"] and dist.get_rank() == 0:  # our ranks are idle here: wait for a calmer machine
        wait_until_quiet(spec["quiet"], longest=spec["quiet_wait"])
    dist.barrier()


def reset_accelerate() -> None:
    """Each Trainer's TrainingArguments set up Accelerate's state anew (as the tests' worker does)."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()
    gc.collect()


def profiled(fn, *args) -> tuple[dict, str]:
    """`fn(*args)` under cProfile; the result and the top functions by cumulative and own time."""
    profile = cProfile.Profile()
    result = profile.runcall(fn, *args)
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("cumulative").print_stats(45)
    stats.sort_stats("tottime").print_stats(30)
    # What is neither model nor wire: the loops, their data, logging, callbacks, telemetry.
    stats.sort_stats("cumulative").print_stats(
        "transformers/trainer|trainer_callback|accelerate|tqdm|hf_actcomp/trainer|engine.py.*stats|pipeline/stats.py|"
        "_local_counters|datasets|data_collator|dataloader|optim", 60)
    return result, text.getvalue()


def main() -> None:
    cli = parse_args()
    # The clock wraps optimizer.step after the schedule did (the schedule's wrapper still runs).
    warnings.filterwarnings("ignore", message="Seems like `optimizer.step\\(\\)` has been overridden")
    spec = json.loads(cli.spec)
    torch.set_num_threads(1)
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])  # one machine: Accelerate reads it
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tokenizer, train = build_data(spec)
    rows, profiles = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in spec["modes"]:
            for k in range(spec["rounds"]):
                wait_for_quiet(spec)
                reset_accelerate()
                call = (run_round, spec, tokenizer, train, os.path.join(tmp, f"{mode}{k}"), mode, k)
                if spec["profile"] and rank == 0:
                    clocks, profiles[f"{mode}{k}"] = profiled(*call)
                else:
                    clocks = call[0](*call[1:])
                for method, clock in clocks.items():
                    ranks: list = [None] * dist.get_world_size()
                    dist.all_gather_object(ranks, clock.marks())
                    rows.append({"mode": mode, "round": k, "method": method, "ranks": ranks})
                reset_accelerate()
                dist.barrier()
    if rank == 0:
        with open(cli.out, "w") as f:
            json.dump({"rows": rows, "profiles": profiles, "package": os.path.dirname(hf_actcomp.__file__)}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())

"""Preference tuning with TRL's `DPOTrainer` over a plan's stages: `ActCompDPOTrainer`.

A TRL script as TRL's own examples write it (`DPOConfig` from the command line), with the plan
and `ActCompDPOTrainer(` where TRL writes `DPOTrainer(` (`--plain` runs plain `DPOTrainer`, for a
side by side). Offline by default: a small random GPT-2, a tokenizer trained on CPython's docs,
and preference pairs built from those docs: the prompt is the start of a line, the chosen
completion its true continuation, the rejected one another line's. The reference is a copy of the
initial policy, or with `--lora` the policy without its adapters. `--dataset_name` /
`--dataset_files` read a preference dataset (prompt, chosen, rejected) with `load_dataset` instead.

    python recipes/dpo.py --output_dir out                          # the stages in one process
    torchrun --nproc-per-node 2 recipes/dpo.py --output_dir out     # one stage per process

Needs TRL: `pip install 'hf-actcomp[trl]'`. On a CPU, DPOConfig needs `--bf16 false` (the
default here) or `--use_cpu true`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import datasets
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, HfArgumentParser, set_seed
from trl import DPOConfig, DPOTrainer

import hf_actcomp
from hf_actcomp.data import build_tokenizer, offline_corpus


@dataclass
class ScriptArguments:
    model_name_or_path: str | None = field(default=None, metadata={
        "help": "A local checkpoint or Hub id; default: a small random GPT-2 (4 layers, hidden 128)."})
    config_overrides: str | None = field(default=None, metadata={"help": "For the default model: 'n_layer=2,...'."})
    dataset_name: str | None = field(default=None, metadata={"help": "A dataset for load_dataset; default: offline."})
    dataset_files: str | None = field(default=None, metadata={"help": "data_files for load_dataset."})
    max_rows: int = field(default=64, metadata={"help": "Offline pairs to build (and train on)."})
    plan: str | None = field(default=None, metadata={"help": "A plan file (YAML/JSON); default: 2 stages, no codec."})
    plain: bool = field(default=False, metadata={"help": "Run trl.DPOTrainer on the whole model instead."})
    lora: bool = field(default=False, metadata={"help": "Train a LoRA adapter (peft_config=LoraConfig(r=8))."})


def offline_pairs(count: int) -> datasets.Dataset:
    """Pairs from the docs: a line's start, its own continuation (chosen), the next line's (rejected)."""
    lines = [line.strip() for doc in offline_corpus() for line in doc.split("\n") if 40 < len(line.strip()) < 120]
    lines = lines[: count + 1]
    cut = [len(t) // 3 for t in lines]
    return datasets.Dataset.from_dict({"prompt": [t[:c] for t, c in zip(lines[:-1], cut, strict=False)],
                                       "chosen": [t[c:] for t, c in zip(lines[:-1], cut, strict=False)],
                                       "rejected": [t[c:] for t, c in zip(lines[1:], cut[1:], strict=True)]})


def main(argv: list[str] | None = None) -> dict:
    parser = HfArgumentParser((ScriptArguments, DPOConfig))
    script, config = parser.parse_args_into_dataclasses(args=argv)
    set_seed(config.seed)
    if script.dataset_name:
        data = datasets.load_dataset(script.dataset_name, data_files=script.dataset_files, split="train")
    else:
        data = offline_pairs(script.max_rows)
    split = data.train_test_split(test_size=0.125, shuffle=False)

    if script.model_name_or_path:
        tokenizer = AutoTokenizer.from_pretrained(script.model_name_or_path)
        model = AutoModelForCausalLM.from_pretrained(script.model_name_or_path)
    else:
        tokenizer = build_tokenizer(offline_corpus()[:2000], vocab_size=512)
        gpt2 = GPT2Config(vocab_size=len(tokenizer), n_positions=max(config.max_length or 128, 128), n_embd=128,
                          n_layer=4, n_head=4, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
        if script.config_overrides:
            gpt2.update_from_string(script.config_overrides)
        model = AutoModelForCausalLM.from_config(gpt2)
    peft_config, ref_model = None, None
    if script.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"], lora_dropout=0.0, task_type="CAUSAL_LM")
    elif not config.precompute_ref_log_probs:
        ref_model = copy.deepcopy(model)  # the initial policy (a model built from a config has no name to load)

    common = dict(model=model, ref_model=ref_model, args=config, train_dataset=split["train"],
                  eval_dataset=split["test"], processing_class=tokenizer, peft_config=peft_config)
    if script.plain:
        trainer = DPOTrainer(**common)
    else:
        plan = hf_actcomp.Plan(num_stages=2) if script.plan is None else hf_actcomp.Plan.from_file(script.plan)
        trainer = hf_actcomp.ActCompDPOTrainer(plan=plan, **common)
    train_result = trainer.train(resume_from_checkpoint=config.resume_from_checkpoint)
    trainer.save_model()
    metrics = {**train_result.metrics, **trainer.evaluate()}
    trainer.log_metrics("all", metrics)
    trainer.save_metrics("all", metrics)
    trainer.save_state()
    # Destroy the process groups before exit (transformers' Trainer.end): left to interpreter
    # shutdown, gloo's destructor can abort a rank ("terminate called without an active exception").
    trainer.end()
    return metrics


if __name__ == "__main__":
    main()

"""Supervised fine-tuning with TRL's `SFTTrainer` over a plan's stages: `ActCompSFTTrainer`.

A TRL script as TRL's own examples write it (`SFTConfig` from the command line), with the plan
and `ActCompSFTTrainer(` where TRL writes `SFTTrainer(` (`--plain` runs plain `SFTTrainer`, for a
side by side). Offline by default: a small random GPT-2, a tokenizer trained on CPython's docs
with a chat template, and rows built from those docs in the form `--dataset_kind` names: `text`,
`prompt_completion` (the loss on the completion only, SFTTrainer's default for it) or
`conversational` (messages; `--assistant_only_loss true` trains on the assistant's turns only).
`--dataset_name` / `--dataset_files` read a dataset with `load_dataset` instead.

    python recipes/sft.py --output_dir out --packing true           # the stages in one process
    torchrun --nproc-per-node 2 recipes/sft.py --output_dir out     # one stage per process

Needs TRL: `pip install 'hf-actcomp[trl]'`. On a CPU, SFTConfig needs `--bf16 false` (the
default here) or `--use_cpu true`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import datasets
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, HfArgumentParser, set_seed
from trl import SFTConfig, SFTTrainer

import hf_actcomp
from hf_actcomp.data import build_tokenizer, offline_corpus

# A chat template whose assistant turns are marked for `assistant_only_loss`.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}"
    "{% else %}{{ message['role'] + ': ' + message['content'] + '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)


@dataclass
class ScriptArguments:
    model_name_or_path: str | None = field(default=None, metadata={
        "help": "A local checkpoint or Hub id; default: a small random GPT-2 (4 layers, hidden 128)."})
    config_overrides: str | None = field(default=None, metadata={"help": "For the default model: 'n_layer=2,...'."})
    dataset_name: str | None = field(default=None, metadata={"help": "A dataset for load_dataset; default: offline."})
    dataset_files: str | None = field(default=None, metadata={"help": "data_files for load_dataset."})
    dataset_kind: str = field(default="text", metadata={
        "help": "The offline rows' form: text, prompt_completion or conversational."})
    max_rows: int = field(default=64, metadata={"help": "Offline rows to build (and train on)."})
    plan: str | None = field(default=None, metadata={"help": "A plan file (YAML/JSON); default: 2 stages, no codec."})
    plain: bool = field(default=False, metadata={"help": "Run trl.SFTTrainer on the whole model instead."})
    lora: bool = field(default=False, metadata={"help": "Train a LoRA adapter (peft_config=LoraConfig(r=8))."})


def offline_rows(kind: str, count: int) -> datasets.Dataset:
    lines = [line.strip() for doc in offline_corpus() for line in doc.split("\n") if 40 < len(line.strip()) < 120][:count]
    if kind == "text":
        return datasets.Dataset.from_dict({"text": lines})
    cut = [len(t) // 3 for t in lines]
    if kind == "prompt_completion":
        return datasets.Dataset.from_dict({"prompt": [t[:c] for t, c in zip(lines, cut, strict=True)],
                                           "completion": [t[c:] for t, c in zip(lines, cut, strict=True)]})
    if kind == "conversational":
        return datasets.Dataset.from_dict({"messages": [
            [{"role": "user", "content": t[:c]}, {"role": "assistant", "content": t[c:]}]
            for t, c in zip(lines, cut, strict=True)]})
    raise ValueError(f"--dataset_kind={kind!r}: choose text, prompt_completion or conversational.")


def load_plan(path: str | None) -> hf_actcomp.Plan:
    """The plan in `path` (JSON or YAML), or two stages without compression."""
    return hf_actcomp.Plan(num_stages=2) if path is None else hf_actcomp.Plan.from_file(path)


def main(argv: list[str] | None = None) -> dict:
    parser = HfArgumentParser((ScriptArguments, SFTConfig))
    script, config = parser.parse_args_into_dataclasses(args=argv)
    set_seed(config.seed)
    if script.dataset_name:
        data = datasets.load_dataset(script.dataset_name, data_files=script.dataset_files, split="train")
    else:
        data = offline_rows(script.dataset_kind, script.max_rows)
    split = data.train_test_split(test_size=0.125, shuffle=False)

    if script.model_name_or_path:
        tokenizer = AutoTokenizer.from_pretrained(script.model_name_or_path)
        model = AutoModelForCausalLM.from_pretrained(script.model_name_or_path)
    else:
        tokenizer = build_tokenizer(offline_corpus()[:2000], vocab_size=512)
        tokenizer.chat_template = CHAT_TEMPLATE
        gpt2 = GPT2Config(vocab_size=len(tokenizer), n_positions=max(config.max_length or 128, 128), n_embd=128,
                          n_layer=4, n_head=4, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
        if script.config_overrides:
            gpt2.update_from_string(script.config_overrides)
        model = AutoModelForCausalLM.from_config(gpt2)
    peft_config = None
    if script.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"], lora_dropout=0.0, task_type="CAUSAL_LM")

    common = dict(model=model, args=config, train_dataset=split["train"], eval_dataset=split["test"],
                  processing_class=tokenizer, peft_config=peft_config)
    if script.plain:
        trainer = SFTTrainer(**common)
    else:
        trainer = hf_actcomp.ActCompSFTTrainer(plan=load_plan(script.plan), **common)
    train_result = trainer.train(resume_from_checkpoint=config.resume_from_checkpoint)
    trainer.save_model()
    metrics = {**train_result.metrics, **trainer.evaluate()}
    trainer.log_metrics("all", metrics)
    trainer.save_metrics("all", metrics)
    trainer.save_state()
    if trainer.is_world_process_zero():
        os.makedirs(config.output_dir, exist_ok=True)
    # Destroy the process groups before exit (transformers' Trainer.end): left to interpreter
    # shutdown, gloo's destructor can abort a rank ("terminate called without an active exception").
    trainer.end()
    return metrics


if __name__ == "__main__":
    main()

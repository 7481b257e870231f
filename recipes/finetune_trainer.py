"""Fine-tune with `hf_actcomp.ActCompTrainer`: the `transformers.Trainer` loop over a plan's stages.

The same script runs the stages in-process (one process) or one stage per process:

    accelerate launch --config_file recipes/configs/cpu_2stage.yaml recipes/finetune_trainer.py
    accelerate launch --config_file recipes/configs/cpu_2stage.yaml recipes/finetune_trainer.py --lora

Defaults are the offline ones of `finetune_gpt2.py` (small GPT-2, CPython's docs, AQ-SGD fw4/bw8).
`--lora` trains a LoRA adapter (`recipes/configs/lora_gpt2.yaml`) and saves the adapter only.
Compared with a plain Trainer script, two lines change: the plan, and `ActCompTrainer`.
"""

from __future__ import annotations

import json
import os

import torch
import yaml
from finetune_gpt2 import build_model, build_parser, check_hub_args, load_data, load_plan
from transformers import AutoTokenizer, TrainingArguments, default_data_collator, set_seed

import hf_actcomp
from hf_actcomp.state.resume import init_distributed

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv=None):
    p = build_parser(__doc__)
    p.set_defaults(output_dir="outputs/finetune_trainer")
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--warmup_steps", type=int, default=10)
    p.add_argument("--lr_scheduler_type", default="linear", help="any of TrainingArguments' (linear, constant, cosine, ...)")
    p.add_argument("--bf16", action="store_true", help="compute in bfloat16 (autocast)")
    p.add_argument("--lora", action="store_true", help="train a LoRA adapter instead of every weight")
    p.add_argument("--lora_config", default=os.path.join(HERE, "configs", "lora_gpt2.yaml"))
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    check_hub_args(args)
    # Before TrainingArguments creates the process group: each torchrun restart finds its peers.
    init_distributed(args.timeout)
    set_seed(args.seed)
    tokenizer = None if args.model == "offline-gpt2" else AutoTokenizer.from_pretrained(args.model)
    tokenizer, train, evaluation = load_data(args, tokenizer)
    plan = load_plan(args.plan, len(train), args)
    model = build_model(args, tokenizer)
    if args.lora:
        from peft import LoraConfig, get_peft_model

        with open(args.lora_config, encoding="utf-8") as f:
            model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **yaml.safe_load(f)))
    training_args = TrainingArguments(
        output_dir=args.output_dir, num_train_epochs=args.epochs, per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size, gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=args.lr, warmup_steps=args.warmup_steps, lr_scheduler_type=args.lr_scheduler_type,
        max_grad_norm=args.max_grad_norm,
        logging_steps=args.logging_steps, eval_strategy="epoch", save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500, seed=args.seed, bf16=args.bf16, report_to=args.report_to or "none",
        use_cpu=not torch.cuda.is_available(), dataloader_drop_last=True,
        push_to_hub=args.push_to_hub, hub_model_id=args.hub_model_id, hub_private_repo=args.hub_private_repo,
    )
    trainer = hf_actcomp.ActCompTrainer(model=model, args=training_args, plan=plan, train_dataset=train,
                                        eval_dataset=evaluation, data_collator=default_data_collator,
                                        processing_class=tokenizer, timeout=args.timeout)
    if args.sample_prompts:  # completions at every evaluation, to the trackers and actcomp_results.json
        trainer.add_callback(hf_actcomp.LogSamplesCallback(trainer, args.sample_prompts,
                                                           max_new_tokens=args.sample_max_new_tokens))
    train_output = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    metrics = trainer.evaluate()
    trainer.save_model(args.output_dir)
    result = {"train_loss": train_output.training_loss, "steps": trainer.state.global_step,
              "processes": trainer.args.world_size, **metrics,
              **{k: v for k, v in trainer.communication_logs().items() if not k.startswith("comm/stage")}}
    if trainer.is_world_process_zero():
        with open(os.path.join(args.output_dir, "results.json"), "w") as f:
            json.dump(result, f, indent=2)
        print(json.dumps(result, indent=2))
    if args.push_to_hub:
        trainer.push_to_hub(commit_message="End of training")  # collective; rank 0 uploads
    # Destroy the process groups before exit: left to interpreter shutdown, gloo's destructor
    # aborted a rank once ("terminate called without an active exception").
    trainer.accelerator.end_training()
    return result


if __name__ == "__main__":
    main()

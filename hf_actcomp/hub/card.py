"""The model card (README.md) of a saved run: its metadata, summary and usage, from the plan,
`actcomp_results.json` and the model's config.

Rendering is apart from the upload (`hub/__init__.py`) because every save writes a card, offline included,
and `hf-actcomp card` re-renders one without ever reaching the Hub.
"""

from __future__ import annotations

import json
import os
import re
from importlib import resources
from typing import Any

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from ..plan import Plan
from ..plan.inference_form import resolve_inference
from ..state.run_results import load_results
from .curves import CURVES_NAME
from .methods import card_citations, card_tags
from .tables import communication_table, evaluation_table, plan_table, timing_table

CARD_NAME = "README.md"
TEMPLATE_NAME = "actcomp_model_card.md"


# What a trainer's `create_model_card(...)` may set (saved under "card" in actcomp_results.json, so
# that every later render of the folder, `hf-actcomp card DIR` included, keeps it).
CARD_FIELDS = ("language", "license", "tags", "model_name", "tasks", "dataset_args")


def model_card(directory: str | os.PathLike, *, repo_id: str | None = None, base_model: str | None = None,
               datasets: str | list[str] | None = None, **fields: Any) -> ModelCard:
    """Render the model card of a saved run from its plan, results and config (nothing is
    written; see `write_model_card`). `fields` (any of `CARD_FIELDS`: `language`, `license`,
    `tags` added to the card's own, `model_name`, `tasks`, `dataset_args`) override what the run
    saved under "card" in its results."""
    unknown = set(fields) - set(CARD_FIELDS)
    if unknown:
        raise TypeError(f"model_card() got unknown fields {sorted(unknown)}; allowed: {', '.join(CARD_FIELDS)}.")
    directory = os.fspath(directory)
    plan = Plan.from_pretrained(directory)
    results = load_results(directory)
    card = {**results.get("card", {}), **{k: v for k, v in fields.items() if v is not None}}
    tasks = _as_list(card.get("tasks"))
    adapter = _read_json(os.path.join(directory, "adapter_config.json"))
    config = _read_json(os.path.join(directory, "config.json"))
    base_model = base_model or results.get("base_model") or (adapter or {}).get("base_model_name_or_path")
    base_model = base_model if _is_repo_id(base_model) else None
    datasets = datasets or results.get("datasets")
    datasets = [datasets] if isinstance(datasets, str) else datasets
    name = repo_id or results.get("repo_id") or card.get("model_name") or os.path.basename(os.path.abspath(directory))
    metrics = results.get("metrics", {})
    tags = card_tags(plan, adapter is not None)
    tags += [t for t in _as_list(card.get("tags")) if t not in tags]
    card_data = ModelCardData(
        model_name=card.get("model_name") or name.split("/")[-1],
        language=card.get("language"),
        license=card.get("license"),
        library_name="peft" if adapter else "transformers",
        base_model=base_model,
        datasets=datasets,
        tags=tags,
        pipeline_tag=tasks[0] if tasks else "text-generation",
        eval_results=_eval_results(metrics, datasets, tasks[0] if tasks else "text-generation",
                                   _first(card.get("dataset_args"))) or None,
    )
    usage, note = _usage(plan, repo_id or "path/to/this/model", adapter is not None, metrics)
    template = resources.files("hf_actcomp.model_cards").joinpath(TEMPLATE_NAME).read_text(encoding="utf-8")
    stats = results.get("stats", {})
    return ModelCard.from_template(
        card_data, template_str=template,
        model_name=name,
        summary=_summary(plan, config, adapter),
        plan_table=plan_table(plan, results.get("blocks")),
        communication_table=communication_table(stats),
        timing_table=timing_table(stats),
        evaluation_table=evaluation_table(metrics),
        curves=CURVES_NAME if os.path.isfile(os.path.join(directory, CURVES_NAME)) else None,
        usage=usage, inference_note=note,
        versions=_versions(adapter is not None),
        citations="\n".join(card_citations(plan)),
    )


def write_model_card(directory: str | os.PathLike, **kwargs: Any) -> ModelCard:
    """Render the card (`model_card`) and write it to `directory/README.md`."""
    card = model_card(directory, **kwargs)
    card.save(os.path.join(directory, CARD_NAME))
    return card


def _read_json(path: str) -> dict | None:
    """A JSON file of the saved folder, or None when the save has no such file."""
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _is_repo_id(name: str | None) -> bool:
    """A Hub model id (`gpt2`, `user/model`), not a local path or an empty name."""
    return bool(name) and not os.path.exists(name) and re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name) is not None


def _summary(plan: Plan, config: dict | None, adapter: dict | None) -> str:
    """The card's first sentence: what was fine-tuned, over how many stages, with which codecs."""
    what = "A LoRA adapter" if adapter else "A causal language model"
    family = f" ({config['model_type']})" if config and "model_type" in config else ""
    replicas = f" x {plan.data_parallel} data-parallel replicas" if plan.data_parallel > 1 else ""
    if plan.per_boundary:
        sent = "with a codec chosen per boundary (below)"
    else:
        sent = (f"with activations sent between stages as `{plan.forward.describe()}` and activation gradients "
                f"as `{plan.backward.describe()}`")
    return f"{what}{family} fine-tuned with hf-actcomp: split into {plan.num_stages} pipeline stages{replicas}, {sent}."


def _as_list(value: str | list[str] | None) -> list[str]:
    return [value] if isinstance(value, str) else list(value or [])


def _first(value: Any) -> Any:
    """Trainer's per-dataset lists (`dataset_args`) describe the first dataset, as the card does."""
    return value[0] if isinstance(value, list) and value else value


def _eval_results(metrics: dict, datasets: list[str] | None, task: str = "text-generation",
                  dataset_args: str | None = None) -> list[EvalResult]:
    """The `model-index` entries: eval loss and perplexity, with the codec and without it."""
    dataset = datasets[0] if isinstance(datasets, list) and datasets else datasets
    out = []
    for key, metric in (("eval_loss", "loss"), ("eval_perplexity", "perplexity"),
                        ("eval_plain_loss", "loss"), ("eval_plain_perplexity", "perplexity")):
        if metrics.get(key) is not None:
            plain = "plain" in key
            out.append(EvalResult(task_type=task, dataset_type=dataset or "custom", dataset_args=dataset_args,
                                  dataset_name=dataset or "held-out evaluation set", metric_type=metric,
                                  metric_value=round(float(metrics[key]), 4),
                                  metric_name=f"{metric} ({'no compression' if plain else 'codec at inference'})"))
    return out


def _usage(plan: Plan, repo: str, adapter: bool, metrics: dict) -> tuple[str, str | None]:
    """How to load the model, and (for a lossy codec) a note on running it as trained."""
    load = (f'from peft import AutoPeftModelForCausalLM\n\nmodel = AutoPeftModelForCausalLM.from_pretrained("{repo}")'
            if adapter else
            f'from transformers import AutoModelForCausalLM\n\nmodel = AutoModelForCausalLM.from_pretrained("{repo}")')
    forwards = {plan.forward_at(b).describe() for b in range(max(plan.num_stages - 1, 1))}
    if forwards == {"none"} or plan.num_stages == 1:
        return load, None
    usage = (load + "\n\n# As trained: the same stage boundaries, compressed (the plan saved with the model)\n"
             "import hf_actcomp\nwith hf_actcomp.compressed_inference(model) as inf:\n"
             "    out = inf.generate(input_ids, max_new_tokens=20)")
    sent = {resolve_inference(plan.forward_at(b)).describe() for b in range(plan.num_stages - 1)}
    note = (f"The model was trained with `{'`, `'.join(sorted(forwards))}` activations between stages. Plain "
            "`from_pretrained` runs it without compression; `compressed_inference` runs it through the plan's "
            f"inference form, `{'`, `'.join(sorted(sent))}` at each boundary (`Compression.inference`).")
    if metrics.get("eval_loss") is not None and metrics.get("eval_plain_loss") is not None:
        note += (f" Measured on the evaluation set: loss {metrics['eval_loss']:.4f} with the codec, "
                 f"{metrics['eval_plain_loss']:.4f} without.")
    return usage, note


def _versions(adapter: bool) -> str:
    """The library versions the card was written with."""
    import accelerate
    import huggingface_hub
    import torch
    import transformers

    from ..version import __version__

    lines = [f"- hf-actcomp {__version__}", f"- transformers {transformers.__version__}",
             f"- torch {torch.__version__}", f"- accelerate {accelerate.__version__}",
             f"- huggingface_hub {huggingface_hub.__version__}"]
    if adapter:
        import peft

        lines.append(f"- peft {peft.__version__}")
    return "\n".join(lines)


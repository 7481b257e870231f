"""Worker of the multi-process TRL preference-trainer tests: `python preference_worker.py SPEC_JSON OUT_DIR`.

SPEC: {"runs": {name: {"trainer": "reward" | "reward_ddp" | "dpo", "plan": Plan dict, "config": config
overrides, "reference": dpo_run's reference ("model" or "lora"), "resume": a checkpoint folder under
OUT_DIR to resume from, "eval_pairs": reward_run's}}}. Each run trains trainer_cases.reward_run
(ActCompRewardTrainer, or TRL's own RewardTrainer under DDP: "reward_ddp", no plan) or dpo_run
(ActCompDPOTrainer); every rank writes `{name}-rank{r}.json`.
"""

import json
import os
import sys

import torch.distributed as dist
from trl import RewardTrainer

from hf_actcomp import ActCompDPOTrainer, ActCompRewardTrainer, Plan

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from trainer_cases import dpo_run, reward_run  # noqa: E402


def main() -> None:
    spec, out_dir = json.loads(sys.argv[1]), sys.argv[2]
    for name, run in spec["runs"].items():
        folder = os.path.join(out_dir, name)
        resume = os.path.join(out_dir, run["resume"]) if run.get("resume") else None
        if run.get("trainer") == "reward_ddp":
            result = reward_run(RewardTrainer, folder, run.get("config"), eval_pairs=run.get("eval_pairs", 6))
            with open(os.path.join(out_dir, f"{name}-rank{dist.get_rank()}.json"), "w") as f:
                json.dump(result, f)
            continue
        plan = Plan.from_dict(run["plan"])
        if run.get("trainer", "reward") == "dpo":
            result = dpo_run(ActCompDPOTrainer, folder, run.get("reference", "model"), run.get("config"),
                             resume=resume, plan=plan)
        else:
            result = reward_run(ActCompRewardTrainer, folder, run.get("config"), resume=resume,
                                eval_pairs=run.get("eval_pairs", 6), plan=plan)
        with open(os.path.join(out_dir, f"{name}-rank{dist.get_rank()}.json"), "w") as f:
            json.dump(result, f)
    dist.barrier()


if __name__ == "__main__":
    main()

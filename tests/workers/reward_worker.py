"""Worker of the multi-process ActCompRewardTrainer tests: `python reward_worker.py SPEC_JSON OUT_DIR`.

SPEC: {"runs": {name: {"plan": Plan dict, "config": RewardConfig overrides}}}. Each run trains
trainer_cases.reward_run with ActCompRewardTrainer; every rank writes `{name}-rank{r}.json`.
"""

import json
import os
import sys

import torch.distributed as dist

from hf_actcomp import ActCompRewardTrainer, Plan

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from trainer_cases import reward_run  # noqa: E402


def main() -> None:
    spec, out_dir = json.loads(sys.argv[1]), sys.argv[2]
    for name, run in spec["runs"].items():
        result = reward_run(ActCompRewardTrainer, os.path.join(out_dir, name), run.get("config"),
                            plan=Plan.from_dict(run["plan"]))
        with open(os.path.join(out_dir, f"{name}-rank{dist.get_rank()}.json"), "w") as f:
            json.dump(result, f)
    dist.barrier()


if __name__ == "__main__":
    main()

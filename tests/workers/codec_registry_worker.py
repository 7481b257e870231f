"""Worker of tests/test_codec_registry.py: `python codec_registry_worker.py PLAN_DIR OUT_DIR STEPS`.

As a user's training script would: register the toy codec, then read the saved plan that names it,
`prepare` this rank's stage and train STEPS steps. Rank 0 writes the losses and the gathered stats.
"""

import json
import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pipeline_cases import sgd_losses  # noqa: E402
from toy_codec import AbsMaxCodec  # noqa: E402

import hf_actcomp  # noqa: E402
from hf_actcomp.debug import debug_model  # noqa: E402


def main() -> None:
    plan_dir, out_dir, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    hf_actcomp.register_codec(AbsMaxCodec)  # before the plan is read: it names the codec
    plan = hf_actcomp.Plan.from_pretrained(plan_dir)
    dist.init_process_group("gloo")
    model = debug_model("gpt2", seed=0)
    pipe = hf_actcomp.prepare(model, plan, timeout=60)
    losses = sgd_losses(pipe, lambda batch: pipe.train_step(batch).loss, steps)
    stats = pipe.stats(gather=True)
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump({"losses": losses, "stats": stats}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

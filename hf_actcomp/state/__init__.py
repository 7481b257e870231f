"""State on disk: everything a run writes so that it can be resumed, inspected or released.

`compression.py` writes and reads the compression state (error-feedback buffers, AQ-SGD memories,
codec counters) as safetensors, `weight_shards.py` a pipeline stage's weights (every stage its own
shard of one Transformers checkpoint), `training_state.py` what a hand-written loop needs to
continue exactly (its weights, optimizer, RNG and place in the data), `resume.py` checkpoints that a kill
cannot tear and the choice of the one to resume from (and `init_distributed`), `run_results.py`
what a run measured (`actcomp_results.json`), and `keys.py` the one place that prefixes state keys.
Tensors go through safetensors and the rest through JSON; only the optimizer's nested state goes
through `torch.save`, read back with `weights_only=True`.
"""

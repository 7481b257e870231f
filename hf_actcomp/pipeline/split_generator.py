"""Generation with the model still split: each stage runs its own layers with a KV cache.

Kept apart from the training step because it shares only the wire with it: the boundaries'
stateless inference codecs, the links' message format, the transport and the tie. After the
prompt, one token's hidden state per row crosses each boundary; the last stage picks the next
tokens (transformers' logits processors and stopping criteria) and sends them to every stage.
`SplitGenerationMixin` gives `Pipeline` its `generate`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from ..models import get_adapter, unwrap_peft
from ..split_generation import (
    CachedStage,
    check_split_generation,
    generation_pieces,
    next_tokens,
    positions_from_mask,
)
from ..telemetry import TrafficCounter
from .link import NEXT_TOKENS_TAG, StageLink, naming_the_step
from .mesh import PipelineMesh
from .stats import StageStats
from .tie import TiedEmbedding
from .transport import Transport


class SplitGenerator:
    """This rank's part of `Pipeline.generate`.

    Args:
        mesh, transport, device: where this stage sits, its wire and its device.
        blocks: the decoder layers of this stage (`range`).
        hidden_size: the width of what crosses a boundary.
        tie: this stage's end of a tied embedding, or None.
        counter: where everything generation sends is counted (`inference`).
        autocast: the context the stage computes in.
    """

    def __init__(self, mesh: PipelineMesh, transport: Transport, device: torch.device, blocks: range,
                 hidden_size: int, tie: TiedEmbedding | None, counter: TrafficCounter,
                 autocast: Callable[[], contextlib.AbstractContextManager]) -> None:
        self.mesh = mesh
        self.transport = transport
        self.device = device
        self.blocks = blocks
        self.hidden_size = hidden_size
        self.tie = tie
        self.counter = counter
        self.autocast = autocast

    def generate(self, model: nn.Module, links: dict[str, StageLink], steps_done: int, input_ids: torch.Tensor,
                 attention_mask: torch.Tensor | None, generation_config, **kwargs) -> torch.Tensor:
        """Prompt + new tokens of `model` (the transformers model, in eval mode), through `links`
        (their boundaries' inference codecs); `steps_done` names the step in a non-finite error."""
        device, mesh, tie = self.device, self.mesh, self.tie
        input_ids = input_ids.to(device)
        attention_mask = (torch.ones_like(input_ids) if attention_mask is None else attention_mask).to(device)
        config, processors, stopping = generation_pieces(model, input_ids, attention_mask, generation_config,
                                                         **kwargs)
        stage = CachedStage(model, get_adapter(model), self.blocks.start, self.blocks.stop, first=mesh.is_first,
                            last=mesh.is_last)
        receiver = links["forward_in"].boundary.inference if "forward_in" in links else None
        sender = links["forward_out"].boundary.inference if "forward_out" in links else None
        # MoE with output_router_logits: the link's side channel carries no loss statistics here
        # (no loss is computed), zeros of its fixed size keep the wire format.
        side = (torch.zeros(links["forward_out"].side_numel, device=device)
                if sender is not None and links["forward_out"].side_numel else None)
        counter = self.counter
        batch = input_ids.shape[0]
        # set by GenerationMixin._prepare_special_tokens (split_generation.py), as `generate` reads it
        pad = config._pad_token_tensor
        has_eos = any(hasattr(criterion, "eos_token_id") for criterion in stopping)
        unfinished = torch.ones(batch, dtype=torch.long, device=device)
        positions = positions_from_mask(attention_mask)
        mask = None if bool((attention_mask == 1).all()) else attention_mask  # as generate passes it
        new, step = input_ids, 0
        # An exact tie's rows of the chosen tokens ride with their ids (one message of a size known
        # in advance, so its receive is posted early): a separate message of the distinct rows,
        # whose receive can only be posted once the ids are in, costs one more round trip per token.
        rows_with_ids = tie is not None and tie.active and tie.compressor is None
        while True:
            if tie is not None and (step == 0 or not rows_with_ids):
                tie.share_rows(new, counter)  # the first stage's copy needs the rows of the new tokens
            shape = (batch, new.shape[1], self.hidden_size)
            h = new
            if not mesh.is_first:
                with naming_the_step("generation", steps_done + 1, mesh.stage):
                    links["forward_in"].post(step, shape, device, f"generation activations of token {step}",
                                             codec=receiver)
                    h, _ = links["forward_in"].receive(step, shape, codec=receiver)
            with self.autocast():
                out = stage(h, mask, positions)
            message = torch.empty(2 * batch, dtype=torch.long, device=device)  # next tokens, unfinished flags
            if mesh.is_last:
                chosen = next_tokens(config, processors, input_ids, out[:, -1])
                if has_eos:
                    chosen = chosen * unfinished + pad * (1 - unfinished)
                unfinished = unfinished & ~stopping(torch.cat([input_ids, chosen[:, None]], dim=-1), None).long()
                message = torch.cat([chosen, unfinished])
            else:
                links["forward_out"].send(step, out, side, codec=sender, counter=counter)
            if mesh.num_stages > 1:
                message = self._share_next_tokens(message, step, rows_with_ids)
            chosen, unfinished = message[:batch], message[batch:]
            input_ids = torch.cat([input_ids, chosen[:, None]], dim=-1)
            if unfinished.max() == 0:
                break
            if mask is not None:
                mask = torch.cat([mask, mask.new_ones((batch, 1))], dim=-1)
            positions = positions[:, -1:] + 1
            new, step = chosen[:, None], step + 1
        self.transport.flush()
        return input_ids

    def _share_next_tokens(self, message: torch.Tensor, step: int, rows_with_ids: bool) -> torch.Tensor:
        """The last stage sends the chosen ids and unfinished flags to every other stage, point to
        point through the transport (a hung peer raises `PeerTimeoutError`, as in training); to the
        first stage, with an exact tie, followed by the tied rows of the chosen tokens (one per
        row of the batch), which it writes into its copy."""
        mesh, counter = self.mesh, self.counter
        ids_bytes = message.numel() * message.element_size()
        tie = self.tie if rows_with_ids else None
        if mesh.is_last:
            ids = message.view(torch.uint8)
            for dst in mesh.ranks[:-1]:
                payload = ids
                if tie is not None and dst == mesh.ranks[0]:
                    rows = tie.param.detach().index_select(0, message[: message.numel() // 2])
                    payload = torch.cat([ids, rows.contiguous().view(-1).view(torch.uint8)])
                self.transport.send(payload, dst, tag=NEXT_TOKENS_TAG)
                counter.add(payload.numel(), payload.numel())
            return message
        rows_bytes = 0
        if tie is not None:
            rows_bytes = message.numel() // 2 * tie.param.shape[1] * tie.param.element_size()
        payload = self.transport.recv(ids_bytes + rows_bytes, mesh.ranks[-1], self.device,
                                      f"the next token ids of generation step {step}", tag=NEXT_TOKENS_TAG)
        message = payload[:ids_bytes].view(torch.long)
        if tie is not None:
            rows = payload[ids_bytes:].view(tie.param.dtype).view(-1, tie.param.shape[1])
            with torch.no_grad():
                tie.param.index_copy_(0, message[: message.numel() // 2], rows)
        return message


class SplitGenerationMixin:
    """`Pipeline.generate` (it sets these attributes)."""

    model: nn.Module
    generator: SplitGenerator
    links: dict[str, StageLink]
    counters: StageStats

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 generation_config=None, **kwargs) -> torch.Tensor:
        """Generate text with the model still split (call on every rank of the pipeline, with the
        same prompts, as `train_step`); every rank returns the same ids (prompt + new tokens).

        Each stage keeps the KV cache of its own layers; after the prompt, one token's hidden
        state per row crosses each boundary, through the plan's inference codec, counted under
        `inference`. The last stage picks the next tokens with transformers' logits processors
        and stopping criteria (`max_new_tokens`, `eos_token_id`, `pad_token_id`, `do_sample`,
        `temperature`, `top_k`, `top_p`, ...) and sends them to the others. Left padding and
        batched prompts of different lengths work as in `model.generate`.

        Greedy decoding and multinomial sampling only, one sequence per prompt: any other mode of
        `model.generate` (`num_beams` > 1, `num_return_sequences` > 1, contrastive search,
        `assistant_model`, constraints, ...), whether from the arguments or from
        `model.generation_config`, raises a ValueError naming it before any work, on every rank
        alike (`hf_actcomp.split_generation.check_generation_mode`; see docs/generation.md).
        """
        model = unwrap_peft(self.model)
        check_split_generation(model, generation_config, **kwargs)  # before any work or message
        was_training = model.training
        model.eval()
        try:
            return self.generator.generate(model, self.links, self.counters.steps, input_ids, attention_mask,
                                           generation_config, **kwargs)
        finally:
            model.train(was_training)

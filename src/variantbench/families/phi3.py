"""Phi-3 and Phi-4 (``phi3``): fused ``qkv_proj`` (q, k, v rows in that order) and ``gate_up_proj``
(gate rows, then up), partial rotary where ``partial_rotary_factor`` < 1 (Phi-4-mini: 0.75; the
engine rotates the first dims the rotary table covers), longrope scaling through transformers'
rotary embedding, and a sliding window over every layer when the config sets one.

Longrope picks its short or long factors by the length of each forward in transformers; the
engine's table rows past ``original_max_position_embeddings`` use the long factors, as a decode step
there does (``Decoder._rope_rows``), so decoding matches transformers; a prompt prefilled past it
does not (transformers rotates the whole prompt with the long factors)."""

from variantbench.families.base import Family, register

FAMILY = register(
    Family(
        name="phi3",
        model_types=("phi3",),
        qkv=("qkv_proj",),
        gate_up=("gate_up_proj",),
        sliding_every_layer=True,
    )
)

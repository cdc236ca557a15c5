"""The universal fallback: any ``AutoModelForCausalLM`` whose family the engine does not register.

A model family the engine does not know (``families``) can still be measured: this
backend runs transformers' own ``generate`` (greedy, a static KV cache where the architecture
takes one, else the dynamic one) with a streamer that stamps each token as it is produced, so
first-token and per-token timings mean what they mean for the engine. The recipes that act on
plain modules apply here too (bf16/fp16, dynamic int8, torchao weight-only, compile of the
forward); structural recipes need a family and are refused before the build.

It is a different system under test: none of the engine's fast paths (pre-transposed and packed
weights, fused q/k/v and gate/up, our KV cache and batches) is used, so its numbers are not the
engine's. ``info()`` says ``backend: transformers`` and why; the report names it beside each
variant, and the recommendation compares variants of one backend unless the plan allows mixing.
It serves one request at a time (``serving/sequential.py``).
"""

from __future__ import annotations

import gc
import time
from typing import Any

from variantbench.backends.base import Encoded, GenerationRequest, GenerationResult, LoadInfo
from variantbench.backends.torch_backend import TorchBackend
from variantbench.compute import on_compute

FALLBACK_NOTE = (
    "transformers fallback: this architecture has no engine family, so transformers' own generate "
    "measured it (none of the engine's fast paths; one request at a time)"
)


class _Stamps:
    """A ``generate`` streamer: the first ``put`` is the prompt, each later one a new token."""

    def __init__(self, clock: Any = time.perf_counter_ns) -> None:
        self.clock = clock
        self.prompt_seen = False
        self.token_ns: list[int] = []

    def put(self, value: Any) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.token_ns.append(self.clock())

    def end(self) -> None:
        pass


class TransformersBackend(TorchBackend):
    """Greedy generation through transformers' ``generate`` for a model of any architecture."""

    @on_compute
    def load(self) -> LoadInfo:
        import torch

        from variantbench.variants import weight_format
        from variantbench.variants.compiled import COMPILE_ATTRIBUTE
        from variantbench.variants.measure import param_bytes

        model, parameters, caveats, t0 = self._load_model()
        load_time = self.spec.load_chain
        caveats.append(FALLBACK_NOTE)
        for caveat in caveats if self.status else ():
            self.status(caveat)
        compile_options = getattr(model, COMPILE_ATTRIBUTE, None)
        if compile_options:
            model.forward = torch.compile(model.forward, **compile_options)
        self._model = model
        self._max_positions = getattr(model.config, "max_position_embeddings", None)
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        eos = eos if eos is not None else self._tokenizer.eos_token_id
        self._stop_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        self._cache = "static"
        c0 = time.perf_counter_ns()
        try:  # the first generation is the readiness check, and says whether a static cache works
            self._generate([self._first_token_id()] * 2, 2)
        except Exception:  # noqa: BLE001 - an architecture without a static cache: the dynamic one
            self._cache = "dynamic"
            self._generate([self._first_token_id()] * 2, 2)
        warm_ns = time.perf_counter_ns() - c0
        self._info = {
            "backend": "transformers",
            "variant": self.name,
            "recipes": [r.model_dump() for r in self.spec.recipes],
            "weight_format": weight_format(load_time),
            "caveats": caveats,
            "engine_fast_paths": False,
            "kv_cache": self._cache,
            "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
            "device": self.device,
            "threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch_version": torch.__version__,
            "architecture": type(model).__name__,
            "model_type": getattr(model.config, "model_type", None),
            "prompt_format": self.prompt_format(),
            "parameters": parameters,
        }
        if compile_options:
            self._info["compile_s"] = warm_ns / 1e9
            self._info["compile"] = dict(compile_options)
        gc.collect()
        return LoadInfo(
            startup_s=(time.perf_counter_ns() - t0) / 1e9,
            param_bytes=param_bytes(model),
            details=dict(self._info),
        )

    @property
    def loaded(self) -> bool:
        return getattr(self, "_model", None) is not None

    @property
    def decoder(self) -> Any:
        return None  # no engine decoder: nothing to profile or batch over

    @property
    def model(self) -> Any:
        """The transformers model (the sequential serving batch steps it)."""
        return getattr(self, "_model", None)

    def compact_weights(self) -> int:
        return 0

    def evaluation_model(self) -> tuple[Any, Any]:
        if self.model is None:
            raise RuntimeError("evaluation_model() before load()")
        return self._model, self._tokenizer

    @on_compute
    def close(self) -> None:
        self._model = None
        super().close()

    def _generate(
        self, ids: list[int], max_new: int, stops: tuple[int, ...] = ()
    ) -> tuple[list[int], list[int]]:
        import torch

        stamps = _Stamps()
        with torch.inference_mode():
            out = self._model.generate(
                torch.tensor([ids], device=self.device), attention_mask=torch.ones(1, len(ids), dtype=torch.long,
                device=self.device), max_new_tokens=max_new, do_sample=False, streamer=stamps,
                eos_token_id=list(stops) or None, pad_token_id=self._tokenizer.pad_token_id or (stops or (0,))[0],
                cache_implementation=self._cache if self._cache == "static" else None,
                temperature=None, top_p=None, top_k=None,
            )  # fmt: skip
        return out[0, len(ids) :].tolist(), stamps.token_ns

    @on_compute
    def token_log_probs(self, ids: list[int]) -> Any:
        import torch

        if self.model is None:
            raise RuntimeError("token_log_probs() before load()")
        with torch.inference_mode():
            logits = self._model(torch.tensor([ids], device=self.device)).logits[0].float()
        return torch.log_softmax(logits, -1).cpu()

    @on_compute
    def generate_encoded(
        self, requests: list[GenerationRequest], encoded: list[Encoded]
    ) -> list[GenerationResult]:
        """One request at a time, in order: transformers' generate has no continuous batching."""
        if not self.loaded:
            raise RuntimeError("generate() before load()")
        results = []
        for req, enc in zip(requests, encoded, strict=True):
            start = time.perf_counter_ns()
            if enc.ids is None:
                results.append(GenerationResult(req.request_id, status="error", error=enc.error,
                                                start_ns=start - enc.encode_ns, end_ns=start))  # fmt: skip
                continue
            try:
                tokens, token_ns = self._generate(enc.ids, req.max_new_tokens, self._stop_ids)
            except Exception as exc:  # noqa: BLE001 - errors are data in the query log
                results.append(GenerationResult(req.request_id, status="error", error=f"{type(exc).__name__}: {exc}",
                                                start_ns=start, end_ns=time.perf_counter_ns()))  # fmt: skip
                continue
            end = time.perf_counter_ns()
            tokens = tokens[: len(token_ns)] if token_ns else tokens
            results.append(
                self.finished(req, enc, tokens, token_ns, start, token_ns[-1] if token_ns else end)
            )
        return results

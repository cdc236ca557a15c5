"""The in-process PyTorch backend: a Hugging Face model folder, a variant recipe, our decode loop."""

from __future__ import annotations

import gc
import sys
import time
from typing import Any

from variantbench.backends import bf16_kernel
from variantbench.backends.base import Encoded, GenerationRequest, GenerationResult, LoadInfo, encode_request
from variantbench.compute import on_compute
from variantbench.errors import UserError
from variantbench.heap import return_heap_to_os
from variantbench.variants.spec import Artifact, VariantSpec, ensure_artifact

# torch's thread count belongs to the process, and interleaved variants live side by side in one:
# the count from before the first backend that set one comes back when the last of them closes.
_threads_before: int | None = None
_thread_pins = 0


def _pin_threads(threads: int) -> None:
    global _threads_before, _thread_pins
    import torch

    if _thread_pins == 0:
        _threads_before = torch.get_num_threads()
    _thread_pins += 1
    torch.set_num_threads(threads)


def _unpin_threads() -> None:
    global _thread_pins
    import torch

    _thread_pins -= 1
    if _thread_pins == 0 and _threads_before is not None:
        torch.set_num_threads(_threads_before)


class TorchBackend:
    """Runs greedy generation for one variant of a model of a registered family, on our engine.

    Picklable until ``load()``: it holds only the folder, the variant name and options.
    """

    def __init__(
        self,
        model_dir: str,
        variant: str | VariantSpec = "fp32",
        device: str = "cpu",
        threads: int | None = None,
        build_seed: int = 0,
        artifact: Artifact | None = None,
    ) -> None:
        self.model_dir = str(model_dir)
        self.spec = variant if isinstance(variant, VariantSpec) else VariantSpec.parse(variant)
        self.name = self.spec.name
        self.artifact = artifact
        self.device = device
        self.threads = threads
        self.build_seed = build_seed
        self.status: Any = None  # optional callable(str): what a long build is doing
        self._decoder: Any = None
        self._tokenizer: Any = None
        self._stop_ids: tuple[int, ...] = ()
        self._pinned_threads = False
        self._max_positions: int | None = None
        self._info: dict[str, Any] = {}
        self.cuda_graphs = True  # on a CUDA device: decode steps replayed from graphs (base.CudaGraphs)

    def __getstate__(self) -> dict[str, Any]:
        if self._decoder is not None:
            raise TypeError("a loaded TorchBackend cannot be pickled; pickle it before load()")
        return self.__dict__.copy()

    # ---- lifecycle ------------------------------------------------------------------------------

    def _load_model(self) -> tuple[Any, int, list[str], int]:
        """What every in-process torch backend loads, in order: the artifact (built before the startup
        clock starts; a no-op when the build step handed it over), then, timed from the returned
        ``t0``, the tokenizer, the model in fp32 with what a build added put back, the device and the
        load-time recipes. Returns (model, parameters before quantization, caveats, t0)."""
        self.artifact = ensure_artifact(
            self.model_dir, self.spec, self.artifact, self.build_seed, self.status
        )
        t0 = time.perf_counter_ns()
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        from variantbench.variants import apply_recipes
        from variantbench.variants.base import restore_built

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()  # e.g. the linear-attn weights it does not know, put back below
        if self.threads:
            _pin_threads(self.threads)
            self._pinned_threads = True
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise UserError("--device cuda was asked for but torch sees no CUDA device")
        source, load_time = self.artifact.source_dir, self.spec.load_chain
        self._tokenizer = AutoTokenizer.from_pretrained(source)
        model = restore_built(
            AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32), source
        ).eval()
        parameters = sum(p.numel() for p in model.parameters())  # before quantization repacks them
        if self.device != "cpu":
            model = model.to(self.device)
        model = apply_recipes(model, load_time)
        caveats = [c for r in load_time if (c := r.caveat(torch.device(self.device)))]
        return model, parameters, caveats, t0

    @on_compute
    def evaluation_model(self) -> tuple[Any, Any]:
        """The variant as a transformers model again (our decoder took its weights over): loaded from
        the variant's folder, what a build added put back, its load-time recipes applied."""
        import torch
        from transformers import AutoModelForCausalLM

        from variantbench.variants import apply_recipes
        from variantbench.variants.base import restore_built

        if self.artifact is None or self._tokenizer is None:
            raise RuntimeError("evaluation_model() before load()")
        source = self.artifact.source_dir
        model = restore_built(
            AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32), source
        ).eval()
        if self.device != "cpu":
            model = model.to(self.device)
        return apply_recipes(model, self.spec.load_chain), self._tokenizer

    @on_compute
    def load(self) -> LoadInfo:
        import torch

        from variantbench.backends.engine import Decoder, UnsupportedModel
        from variantbench.families import family_for, registered_types
        from variantbench.variants import weight_format
        from variantbench.variants.compiled import COMPILE_ATTRIBUTE
        from variantbench.variants.measure import param_bytes, streamed_bytes

        model, parameters, caveats, t0 = self._load_model()
        recipes, load_time, built = self.spec.recipes, self.spec.load_chain, self.artifact.manifest
        for caveat in caveats if self.status else ():
            self.status(caveat)
        nbytes = param_bytes(model)
        streamed = streamed_bytes(model)
        config = model.config
        family = family_for(config)
        if family is None:  # the registry sends such a model to the transformers fallback
            raise UserError(
                f"{type(model).__name__} (model type {config.model_type!r}) has no engine family; registered: "
                f"{', '.join(registered_types())}; the transformers fallback backend runs it"
            )
        try:
            self._decoder = Decoder(model, family)
        except UnsupportedModel as exc:
            raise UserError(str(exc)) from None
        eager_why = None
        if self._decoder.device.type == "cuda":
            eager_why = self._decoder.use_cuda_graphs(self.cuda_graphs) or (
                None if self.cuda_graphs else "model.cuda_graphs is off"
            )
        self._max_positions = getattr(config, "max_position_embeddings", None)
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        eos = eos if eos is not None else self._tokenizer.eos_token_id
        self._stop_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        self._info = {
            "backend": "torch",
            "variant": self.name,
            "recipes": [r.model_dump() for r in recipes],
            "weight_format": weight_format(load_time),
            "caveats": caveats,
            "built": {k: built[k] for k in ("key", "parameters", "bytes_on_disk", "build_s", "notes")}
            if built
            else None,
            "dtype": str(self._decoder.dtype).replace("torch.", ""),
            "device": self.device,
            "threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch_version": torch.__version__,
            "architecture": type(model).__name__,
            "family": family.name,
            "prompt_format": self.prompt_format(),
            "layers": len(self._decoder.layers),
            "parameters": parameters,
            "streamed_bytes": streamed,  # read per decoded token (a separate embedding table is not)
            "decode": self._decoder.decode_mode,  # eager | cuda-graphs
            "decode_eager_why": eager_why,
        }
        compile_options = getattr(model, COMPILE_ATTRIBUTE, None)
        del model
        gc.collect()
        return_heap_to_os()  # the loaded checkpoint's freed pages: 80 MiB of RSS here
        compile_ns = 0
        if compile_options:
            # Compile now, on the shapes a run will bring (batch 1, and batch > 1), so no timed
            # query ever pays for it; reported apart as compile_s (inside startup, never inside a latency).
            c0 = time.perf_counter_ns()
            self._decoder.compile_decode_step(**compile_options)
            first = self._first_token_id()
            # three graphs: the first step (its position still a constant), later steps at batch
            # 1, and batch > 1; Dynamo makes the position and the batch size dynamic on change.
            # Batch 3 too: the pieces between the packed matmuls (run outside the graph, see
            # engine._packed_linear_eager) see their second batch size only there.
            self._decoder.generate([[first]], 4)
            self._decoder.generate([[first], [first, first]], 4)
            self._decoder.generate([[first], [first, first], [first]], 4)
            compile_ns = time.perf_counter_ns() - c0
            self._info["compile_s"] = compile_ns / 1e9
            self._info["compile"] = dict(compile_options)
        # Ready means a token can be produced: one tiny generation touches every weight once. Two
        # prompt tokens, so the engine's multi-row weight layout is made now, not in a timed query.
        self._decoder.generate([[self._first_token_id()] * 2], 1)
        startup_s = (time.perf_counter_ns() - t0) / 1e9
        return LoadInfo(startup_s=startup_s, param_bytes=nbytes, details=dict(self._info))

    def info(self) -> dict[str, Any]:
        out = dict(self._info) if self._info else {"backend": "torch", "variant": self.name}
        # the kernels this process's products chose at a decode step's rows, once run
        fmt = str(self._info.get("weight_format", ""))
        int8 = sys.modules.get("variantbench.variants.int8")
        chosen = [
            int8.kernel_summary() if int8 is not None and "int8" in fmt else None,
            bf16_kernel.summary() if "bfloat16" in fmt else None,
        ]
        if any(chosen):
            out["kernels"] = "; ".join(c for c in chosen if c)
        if self._decoder is not None:
            out["decode_step"] = self._decoder.batch1_step
        return out

    @on_compute
    def compact_weights(self) -> int:
        """One copy of each layer's weights (served fp32 on CPU: 405 of 513 MiB freed for the
        default model, idle RSS 1,446 -> ~1,000 MiB, batch-1 decode ~10% slower)."""
        if self._decoder is None:
            return 0
        freed = self._decoder.drop_plain_copies()
        gc.collect()
        return_heap_to_os()
        return freed

    @on_compute
    def close(self) -> None:
        self._decoder = None
        self._tokenizer = None
        if self._pinned_threads:
            _unpin_threads()
            self._pinned_threads = False
        gc.collect()

    # ---- serving --------------------------------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def decoder(self) -> Any:
        """Our engine's Decoder (the diagnosis profiles it; serving batches over it)."""
        return self._decoder

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self._stop_ids

    @property
    def max_positions(self) -> int | None:
        return self._max_positions

    # ---- generation -----------------------------------------------------------------------------

    def prompt_format(self) -> str:
        """How samples become token ids: the model's own chat template, or plain completion text."""
        if getattr(self._tokenizer, "chat_template", None):
            return "chat template"
        return "plain completion (the tokenizer has no chat template)"

    def _first_token_id(self) -> int:
        tok = self._tokenizer
        for candidate in (tok.bos_token_id, tok.eos_token_id, 0):
            if candidate is not None:
                return int(candidate)
        return 0

    def encode(self, request: GenerationRequest) -> list[int]:
        """Token ids of the request, through the chat template when the tokenizer has one."""
        return encode_request(self._tokenizer, request)

    @on_compute
    def token_log_probs(self, ids: list[int]) -> Any:
        """Next-token log-probabilities at every position (logit fidelity): float32 [len(ids), vocab]."""
        if self._decoder is None:
            raise RuntimeError("token_log_probs() before load()")
        return self._decoder.log_probs(ids).cpu()

    def tokenize(self, text: str) -> list[int]:
        return list(self._tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode_ahead(self, request: GenerationRequest) -> Encoded:
        """The request's ids, checked against the model's limits; errors are data, not raised."""
        t0 = time.perf_counter_ns()
        try:
            ids = self.encode(request)
            if not ids:
                raise ValueError("prompt encodes to zero tokens")
            if request.max_new_tokens < 1:
                raise ValueError("max_new_tokens must be at least 1")
            if self._max_positions and len(ids) + request.max_new_tokens > self._max_positions:
                raise ValueError(
                    f"prompt of {len(ids)} tokens + {request.max_new_tokens} new exceeds the model's "
                    f"{self._max_positions} positions"
                )
        except Exception as exc:
            took = time.perf_counter_ns() - t0
            return Encoded(None, str(exc), took, took)
        took = time.perf_counter_ns() - t0
        return Encoded(ids, None, took, took)

    @property
    def loaded(self) -> bool:
        """Whether ``load()`` has run (and ``close()`` not): what generates is in place."""
        return self._decoder is not None

    def finished(self, req: GenerationRequest, enc: Encoded, tokens: list[int], token_ns: list[int],
                 start_ns: int, end_ns: int) -> GenerationResult:  # fmt: skip
        """A completed request's result: its text (stop tokens left out) and where its CPU time went."""
        shown = [t for t in tokens if t not in self._stop_ids]
        d0 = time.perf_counter_ns()
        text = self._tokenizer.decode(shown, skip_special_tokens=True)
        cpu_work = {"encode_ms": enc.encode_ns / 1e6, "encode_waited_ms": enc.waited_ns / 1e6,
                    "detokenize_ms": (time.perf_counter_ns() - d0) / 1e6}  # fmt: skip
        return GenerationResult(req.request_id, text=text.strip(), input_tokens=len(enc.ids or ()),
                                output_tokens=len(tokens), start_ns=start_ns,
                                first_token_ns=token_ns[0] if token_ns else None, token_ns=list(token_ns),
                                end_ns=end_ns, cpu_work=cpu_work)  # fmt: skip

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Encode inline, then generate: the model's thread does the CPU work itself."""
        if not self.loaded:
            raise RuntimeError("generate() before load()")
        return self.generate_encoded(requests, [self.encode_ahead(r) for r in requests])

    @on_compute
    def generate_encoded(
        self, requests: list[GenerationRequest], encoded: list[Encoded]
    ) -> list[GenerationResult]:
        if self._decoder is None:
            raise RuntimeError("generate() before load()")
        results: dict[str, GenerationResult] = {}
        batch: list[tuple[GenerationRequest, list[int], Encoded]] = []
        for req, enc in zip(requests, encoded, strict=True):
            if enc.ids is None:
                now = time.perf_counter_ns()
                results[req.request_id] = GenerationResult(
                    req.request_id, status="error", error=enc.error, start_ns=now - enc.encode_ns, end_ns=now
                )
            else:
                batch.append((req, enc.ids, enc))
        if batch:
            start = time.perf_counter_ns()
            try:
                out = self._decoder.generate(
                    [ids for _, ids, _ in batch],
                    [req.max_new_tokens for req, _, _ in batch],
                    stop_ids=self._stop_ids,
                    start_ns=start,
                )
            except Exception as exc:
                end = time.perf_counter_ns()
                for req, _, _ in batch:
                    results[req.request_id] = GenerationResult(
                        req.request_id,
                        status="error",
                        error=f"{type(exc).__name__}: {exc}",
                        start_ns=start,
                        end_ns=end,
                    )
            else:
                for (req, _, enc), tokens, timing in zip(batch, out.token_ids, out.timings, strict=True):
                    results[req.request_id] = self.finished(
                        req, enc, tokens, timing.token_ns, timing.start_ns, timing.end_ns
                    )
        return [results[req.request_id] for req in requests]

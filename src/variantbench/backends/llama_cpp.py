"""llama.cpp backend (llama-cpp-python): the gguf-* variants, greedy, with per-token times.

Requests are encoded with the model's Hugging Face tokenizer exactly as the other engines do (chat
template included) and handed to llama.cpp as token ids, so every engine sees the same ids and the
comparison is of engines, not tokenizers. One sequence at a time (llama-cpp-python's ``Llama``
holds one): a batch is served in turn.

Honest timings need two resets per request: ``Llama.generate`` reuses the previous prompt's KV
cache when the new prompt shares a prefix (a chat template always does), which would fake a fast
prefill, so the context is reset and its memory cleared first; and llama.cpp's own perf counters
accumulate across calls, so they are reset too and read after each request as a cross-check of our
clock (``engine_timings``: prompt-eval and eval milliseconds and counts). Picklable until ``load()``.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path
import time
from typing import Any

from variantbench.backends.base import (
    GenerationRequest,
    GenerationResult,
    LoadInfo,
    encode_request,
    failed_result,
    sequential_result,
)
from variantbench.compute import on_compute
from variantbench.variants.spec import Artifact, VariantSpec, check_engine, ensure_artifact, plain_artifact


class LlamaCppBackend:
    def __init__(
        self,
        model_dir: str,
        variant: str | VariantSpec,
        threads: int | None = None,
        build_seed: int = 0,
        n_ctx: int = 4096,
        gguf_file: str | None = None,
        artifact: Artifact | None = None,
    ) -> None:
        self.model_dir = str(model_dir)
        self.spec = variant if isinstance(variant, VariantSpec) else VariantSpec.parse(variant)
        self.name = self.spec.name
        self.artifact = artifact
        self.threads = threads
        self.build_seed = build_seed
        self.n_ctx = n_ctx
        self.gguf_file = gguf_file  # run this file instead of building one from the recipe
        self.status: Any = None
        self._llm: Any = None
        self._scorer: Any = None
        self._tokenizer: Any = None
        self._stop_ids: tuple[int, ...] = ()
        self._path: Path | None = None
        self._info: dict[str, Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        if self._llm is not None:
            raise TypeError("a loaded LlamaCppBackend cannot be pickled; pickle it before load()")
        return self.__dict__.copy()

    def _threads(self) -> int:
        return self.threads or len(os.sched_getaffinity(0))

    def _open(self, path: Path, n_ctx: int, logits_all: bool = False) -> Any:
        from llama_cpp import Llama

        return Llama(
            model_path=str(path),
            n_ctx=n_ctx,
            n_batch=min(512, n_ctx),
            n_threads=self._threads(),
            n_threads_batch=self._threads(),
            logits_all=logits_all,
            # llama.cpp's own default since 2025 (``-fa auto``), off in llama-cpp-python's wrapper:
            # prompt processing of the default GGUF ~15% faster on 2 AVX-512 cores, and the serving
            # batch (which copies these settings) needs it, see ``serving/llama_cpp_batch.py``
            flash_attn=True,
            verbose=False,
        )

    @on_compute
    def load(self) -> LoadInfo:
        from variantbench.variants.gguf import GgufVariant, gguf_file_type, require_llama_cpp

        if self.gguf_file:  # a given file: nothing to build, but the recipe must still be a GGUF one
            check_engine(self.spec, GgufVariant)
            self.artifact = plain_artifact(self.model_dir)
        else:
            self.artifact = ensure_artifact(self.model_dir, self.spec, self.artifact, self.build_seed,
                                            self.status, engine_type=GgufVariant)  # fmt: skip
        t0 = time.perf_counter_ns()
        from transformers import AutoTokenizer

        llama_cpp = require_llama_cpp()
        engine, source = self.spec.engine, self.artifact.source_dir
        path = Path(self.gguf_file or self.artifact.engine_path or "")
        self._path = path
        self._tokenizer = AutoTokenizer.from_pretrained(source)
        self._llm = self._open(path, self.n_ctx)
        eos = self._tokenizer.eos_token_id
        model_eos = self._llm.token_eos()
        self._stop_ids = tuple(sorted({int(t) for t in (eos, model_eos, *self._end_of_generation())
                                       if t is not None and t >= 0}))  # fmt: skip
        self._info = {
            "backend": "llama.cpp",
            "variant": self.name,
            "weight_format": type(engine).weight_format,
            "gguf": str(path),
            "gguf_file_type": gguf_file_type(path),
            "llama_cpp_python": llama_cpp.__version__,
            "n_ctx": self.n_ctx,
            "threads": self._threads(),
            "device": "cpu",
            "batching": "one sequence at a time",
        }
        self.generate([GenerationRequest("warm", prompt="Hello", max_new_tokens=1)])  # ready: a token out
        startup_s = (time.perf_counter_ns() - t0) / 1e9
        return LoadInfo(startup_s=startup_s, param_bytes=path.stat().st_size, details=dict(self._info))

    def info(self) -> dict[str, Any]:
        return dict(self._info) if self._info else {"backend": "llama.cpp", "variant": self.name}

    @on_compute
    def close(self) -> None:
        for llm in (self._llm, self._scorer):
            if llm is not None:
                llm.close()
        self._llm = self._scorer = None
        self._tokenizer = None
        gc.collect()

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def llm(self) -> Any:
        """The loaded ``llama_cpp.Llama`` (serving batches its low-level context)."""
        return self._llm

    def _end_of_generation(self) -> list[int]:
        """Every token llama.cpp ends a generation at (``llama_vocab_is_eog``), as its own server
        does: for SmolLM2 <|endoftext|> and id 4 beside the EOS <|im_end|>. Stopping at the EOS
        alone, our server answered ~6 tokens longer than llama.cpp's on the same prompts."""
        from variantbench.variants.gguf import require_llama_cpp

        llama_cpp = require_llama_cpp()
        vocab = llama_cpp.llama_model_get_vocab(self._llm.model)
        return [t for t in range(self._llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t)]

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self._stop_ids

    def thread_count(self) -> int:
        """Threads it runs on (the ``threads`` attribute is the request, None for every core)."""
        return self._threads()

    def tokenize(self, text: str) -> list[int]:
        return list(self._tokenizer(text, add_special_tokens=False)["input_ids"])

    @on_compute
    def token_log_probs(self, ids: list[int]) -> Any:
        """Next-token log-probabilities at every position (logit fidelity): float32 [len(ids), vocab].

        A second context keeps logits for every position (``logits_all``), sized to this text, so the
        serving context does not carry a [n_ctx, vocab] score table.
        """
        import numpy as np
        import torch

        if self._llm is None or self._path is None:
            raise RuntimeError("token_log_probs() before load()")
        if self._scorer is None or self._scorer.n_ctx() < len(ids):
            if self._scorer is not None:
                self._scorer.close()
            self._scorer = self._open(self._path, max(len(ids), 64), logits_all=True)
        self._scorer.reset()
        self._scorer.eval(ids)
        logits = torch.from_numpy(np.array(self._scorer.scores[: len(ids)], dtype=np.float32))
        return torch.log_softmax(logits, dim=-1)

    def _one(self, req: GenerationRequest) -> GenerationResult:
        import llama_cpp

        llm = self._llm
        start = time.perf_counter_ns()
        try:
            ids = encode_request(self._tokenizer, req)
            if not ids:
                raise ValueError("prompt encodes to zero tokens")
            if req.max_new_tokens < 1:
                raise ValueError("max_new_tokens must be at least 1")
            if len(ids) + req.max_new_tokens > self.n_ctx:
                raise ValueError(
                    f"prompt of {len(ids)} tokens + {req.max_new_tokens} new exceeds the context of {self.n_ctx}"
                )
            llm.reset()  # no reuse of the previous prompt's KV cache
            memory = llama_cpp.llama_get_memory(llm.ctx)
            if memory is not None:
                llama_cpp.llama_memory_clear(memory, True)
            llama_cpp.llama_perf_context_reset(llm.ctx)
            start = time.perf_counter_ns()
            tokens: list[int] = []
            token_ns: list[int] = []
            for token in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
                token_ns.append(time.perf_counter_ns())
                tokens.append(int(token))
                if tokens[-1] in self._stop_ids or len(tokens) >= req.max_new_tokens:
                    break
            perf = llama_cpp.llama_perf_context(llm.ctx)
        except Exception as exc:  # noqa: BLE001 - a failed request is data
            return failed_result(req.request_id, exc, start)
        timings = {"prompt_eval_ms": perf.t_p_eval_ms, "prompt_tokens": perf.n_p_eval, "eval_ms": perf.t_eval_ms,
                   "eval_tokens": perf.n_eval}  # fmt: skip
        return sequential_result(
            req.request_id, self._tokenizer, ids, tokens, token_ns, start, self._stop_ids, timings
        )

    @on_compute
    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        if self._llm is None:
            raise RuntimeError("generate() before load()")
        return [self._one(r) for r in requests]

